package main

import (
	"bytes"
	"fmt"
	"image/png"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"distill/train/testcache"
)

// TestPlot trains two tiny runs on a real cache (KD + SFT, and SFT only
// with kd_weight 0), so that the metrics are the trainer's own, and plots
// them overlaid with a reference line: the PNG decodes at the size asked
// for, and the command names the panels it drew (no KD panel entry for
// the SFT-only run is checked in package runplot). Bad flags are errors
// that say what to give.
func TestPlot(t *testing.T) {
	dir := t.TempDir()
	b, err := testcache.Build(testcache.Options{Dir: dir, Vocab: 97, K: 8, Samples: 40, Chunk: 16, MinLen: 6, MaxLen: 30, Seed: 3})
	if err != nil {
		t.Fatal(err)
	}
	cfg := filepath.Join(dir, "run.yaml")
	os.WriteFile(cfg, []byte(`run_dir: unused
model:
  random: {arch: qwen3, vocab_size: 97, hidden_size: 32, num_hidden_layers: 1, num_attention_heads: 2,
           num_key_value_heads: 1, head_dim: 16, intermediate_size: 64, max_position_embeddings: 128}
  tokenizer_fingerprint: testcache-tokenizer
data: {cache: [nowhere], seq_len: 64, global_batch_tokens: 128, eval_range: [0, 8]}
optim: {lr: 3e-3, min_lr: 3e-4, warmup_steps: 1}
train: {max_steps: 4, threads: 2}
eval: {every: 2}
checkpoint: {every: 4}
log: {progress: "off", tensorboard: false}
`), 0o644)
	kd, sft := filepath.Join(dir, "kd"), filepath.Join(dir, "a=b")
	if err := runTrain([]string{"--config", cfg, "--run-dir", kd, "--cache", b.CacheDir}); err != nil {
		t.Fatal(err)
	}
	if err := runTrain([]string{"--config", cfg, "--run-dir", sft, "--cache", b.CacheDir, "--set", "distill.kd_weight=0", "--set", "distill.sft_weight=1"}); err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	stdout = &out
	defer func() { stdout = os.Stdout }()
	png1 := filepath.Join(dir, "curves.png")
	// "KD run=DIR" is a label; "DIR/a=b", an existing directory, is a path.
	if err := runPlot([]string{"--run", "KD run=" + kd, "--run", sft, "--hline", "teacher CE=2.5", "--hline", "loss:floor=1",
		"--out", png1, "--width", "900", "--height", "600", "--title", "two runs"}); err != nil {
		t.Fatal(err)
	}
	if want := "wrote " + png1 + ": 2 runs, panels loss, kd, ce, lr, grad_norm, accuracy\n"; out.String() != want {
		t.Errorf("printed %q, want %q", out.String(), want)
	}
	out.Reset()
	if err := runPlot([]string{"--run", kd, "--run", sft, "--panels", "kd,ce", "--from", "3", "--out", png1}); err != nil {
		t.Fatal(err)
	}
	if want := "wrote " + png1 + ": 2 runs, panels kd, ce\n"; out.String() != want {
		t.Errorf("printed %q, want %q", out.String(), want)
	}
	out.Reset()
	if err := runPlot([]string{"--run", kd, "--panels", "kd", "--out", png1}); err != nil {
		t.Fatal(err)
	}
	if want := "wrote " + png1 + ": 1 run, panels kd\n"; out.String() != want {
		t.Errorf("printed %q, want %q", out.String(), want)
	}
	out.Reset()
	if err := runPlot([]string{"--run", "KD run=" + kd, "--run", sft, "--hline", "teacher CE=2.5", "--hline", "loss:floor=1",
		"--out", png1, "--width", "900", "--height", "600", "--title", "two runs"}); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(png1)
	if err != nil {
		t.Fatal(err)
	}
	img, err := png.Decode(f)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	if r := img.Bounds(); r.Dx() != 900 || r.Dy() != 600 {
		t.Errorf("PNG %v, want 900x600", r)
	}

	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--out", png1}, "--run DIR is required"},
		{[]string{"--run", kd}, "--out FILE.png is required"},
		{[]string{"--run", kd, "--out", png1, "--cols", "0"}, "--cols 0"},
		{[]string{"--run", kd, "--out", png1, "--hline", "teacher"}, "[PANEL:]LABEL=VALUE"},
		{[]string{"--run", kd, "--out", png1, "--hline", "speed:x=1"}, ""}, // a label with a colon, on the ce panel: fine
		{[]string{"--run", dir, "--out", png1}, "has no metrics.jsonl"},
		{[]string{"--run", filepath.Join(dir, "nope"), "--out", png1}, "nope"},
		{[]string{"--run", kd, "--out", filepath.Join(dir, "c.gif")}, ".png, .svg or .pdf"},
		{[]string{"--run", kd, "--out", png1, "extra"}, "unexpected arguments"},
		{[]string{"--run", kd, "--out", png1, "--panels", "ce,speed"}, `unknown panel "speed"`},
		{[]string{"--run", kd, "--out", png1, "--from", "1000"}, "nothing to draw"},
	} {
		err := runPlot(c.args)
		if c.want == "" {
			if err != nil {
				t.Errorf("%v: %v", c.args, err)
			}
			continue
		}
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%v: %v, want it to say %q", c.args, err, c.want)
		}
	}
}

// TestPlotTornLines: a metrics.jsonl with a torn line in the middle (a
// run killed mid-write, then resumed after it) is plotted, with one
// warning naming the file and line; it was an error ("line 2: invalid
// character"), and nothing was drawn. Two torn lines are still one
// warning. A file where no line is JSON stays an error.
func TestPlotTornLines(t *testing.T) {
	dir := t.TempDir()
	good := `{"type":"train","step":%d,"loss":1,"kd":1,"ce":3,"lr":0.1,"grad_norm":4}` + "\n"
	torn := `{"type":"train","step":9,"lo`
	run := func(name string, lines ...string) string {
		d := filepath.Join(dir, name)
		os.MkdirAll(d, 0o755)
		os.WriteFile(filepath.Join(d, "metrics.jsonl"), []byte(strings.Join(lines, "")), 0o644)
		return d
	}
	one := run("one", fmt.Sprintf(good, 1), torn+fmt.Sprintf(good, 2), fmt.Sprintf(good, 3))
	two := run("two", fmt.Sprintf(good, 1), torn+"\n", fmt.Sprintf(good, 2), "\x00\x00\x00\n", fmt.Sprintf(good, 3), torn)
	none := run("none", torn+"\n", "hello\n")
	png1 := filepath.Join(dir, "c.png")
	var log bytes.Buffer
	plotLog = &log
	defer func() { plotLog = os.Stderr }()
	for _, c := range []struct {
		dir, warn string
	}{
		{one, filepath.Join(one, "metrics.jsonl") + ":2: not JSON (a write cut short by a crash?): skipped; the rest of the run is plotted\n"},
		{two, filepath.Join(two, "metrics.jsonl") + ":2: this line and 1 more (lines 4) are not JSON (a write cut short by a crash?): skipped; the rest of the run is plotted\n"},
	} {
		log.Reset()
		var stderr bytes.Buffer
		if code := commands.Run([]string{"plot", "--run", c.dir, "--out", png1}, io.Discard, &stderr); code != 0 {
			t.Errorf("plot %s: exit %d: %s", c.dir, code, stderr.String())
		}
		if want := "student plot: warning: " + c.warn; log.String() != want {
			t.Errorf("plot %s warned %q, want %q", c.dir, log.String(), want)
		}
	}
	var stderr bytes.Buffer
	if code := commands.Run([]string{"plot", "--run", none, "--out", png1}, io.Discard, &stderr); code != 1 ||
		!strings.Contains(stderr.String(), filepath.Join(none, "metrics.jsonl")+" line 1: ") {
		t.Errorf("plot of a file with no JSON line: exit %d, stderr %q; want 1 and an error naming line 1", code, stderr.String())
	}
}
