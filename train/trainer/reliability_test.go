package trainer

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"distill/cache"
	"distill/cache/cachetest"
	"distill/internal/testdirs"
	"distill/model"
	"distill/train/testcache"
)

// handCache writes a cache of len(lens) samples of the given lengths
// (V = 128, k = 8, tokenizer "tok"), committing only the chunks of size
// chunk that start in commit (nil: all of them).
func handCache(t *testing.T, lens []int, chunk int, commit map[int]bool) string {
	t.Helper()
	dir := t.TempDir()
	const V, K = 128, 8 // cachetest draws first tokens among 100 ids
	c, err := cache.Create(dir, cache.Manifest{TeacherFingerprint: "t", TokenizerFingerprint: "tok", DatasetFingerprint: "d",
		VocabSize: V, K: K, Temperature: 1, Samples: int64(len(lens)), Encoding: cache.EncodingLossless}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for a := 0; a < len(lens); a += chunk {
		if commit != nil && !commit[a] {
			continue
		}
		b := min(a+chunk, len(lens))
		w, err := c.BeginChunk(int64(a), int64(b))
		if err != nil {
			t.Fatal(err)
		}
		for i := a; i < b; i++ {
			g := cachetest.New(V, K, "bpe", uint64(i)+1).Sample(lens[i])
			if err := w.Add(cache.Sample{Index: int64(i), Tokens: g.Tokens, Mask: g.Mask, TopKIDs: g.TopKIDs, TopKLogProbs: g.TopKLogProbs}); err != nil {
				t.Fatal(err)
			}
		}
		if err := w.Commit(); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

func handConfig(t *testing.T, cacheDir, runDir string, over ...string) *Config {
	t.Helper()
	return tinyConfig(t, &testcache.Built{CacheDir: cacheDir}, runDir, append([]string{"model.tokenizer_fingerprint=tok", "model.random.vocab_size=128"}, over...)...)
}

// TestEvalRangeNotFilled: an eval_range reaching into samples the cache
// does not hold (a partly filled cache) is refused at startup, naming the
// missing samples, before any step; eval.max_samples that keeps the eval
// inside the filled part is accepted.
func TestEvalRangeNotFilled(t *testing.T) {
	lens := make([]int, 64)
	for i := range lens {
		lens[i] = 12
	}
	dir := handCache(t, lens, 16, map[int]bool{16: true, 32: true, 48: true}) // [0, 16) missing
	runDir := t.TempDir()
	var log strings.Builder
	res, err := Run(handConfig(t, dir, runDir, "data.eval_range=[8,24]", "train.max_steps=4", "eval.every=2"), Options{Log: &log})
	if !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "data.eval_range") || !strings.Contains(err.Error(), "[8, 16)") {
		t.Fatalf("eval_range over unfilled samples: %v", err)
	}
	if res != nil && len(res.Steps) > 0 {
		t.Fatalf("%d steps ran before the eval range was refused", len(res.Steps))
	}
	if _, err := Run(handConfig(t, dir, runDir, "data.eval_range=[16,24]", "train.max_steps=3", "eval.every=1"), Options{Log: io.Discard}); err != nil {
		t.Fatalf("a filled eval range: %v", err)
	}
}

// TestDataErrorSavesCheckpoint: a sample longer than seq_len found in the
// middle of a run (data.truncate off) ends it with ErrData, after a
// checkpoint of the last finished step that the error names.
func TestDataErrorSavesCheckpoint(t *testing.T) {
	lens := make([]int, 96)
	for i := range lens {
		lens[i] = 10
	}
	lens[70] = 100 // seq_len is 64
	dir := handCache(t, lens, 16, nil)
	runDir := t.TempDir()
	res, err := Run(handConfig(t, dir, runDir, "train.max_steps=40", "checkpoint.every=0", "eval.every=0"), Options{Log: io.Discard})
	if !errors.Is(err, ErrData) {
		t.Fatalf("want ErrData for the long sample, got %v", err)
	}
	n := len(res.Steps)
	if n == 0 {
		t.Fatal("the long sample is in step 1 of this order: the test needs it later (change its index)")
	}
	want := checkpointDir(runDir, n)
	if ck, _ := LatestCheckpoint(runDir); ck != want || !strings.Contains(err.Error(), want) {
		t.Fatalf("after %d steps: newest checkpoint %q, error %v; want %s saved and named", n, ck, err, want)
	}
	if steps := metricSteps(t, runDir); len(steps) != n {
		t.Fatalf("metrics.jsonl has steps %v, want 1..%d", steps, n)
	}
}

// stopAtLine closes stop when a line containing at is written.
type stopAtLine struct {
	mu   sync.Mutex
	at   string
	stop chan struct{}
	buf  strings.Builder
	done bool
}

func (w *stopAtLine) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.buf.Write(p)
	if !w.done && strings.Contains(w.buf.String(), w.at) {
		close(w.stop)
		w.done = true
	}
	return len(p), nil
}

// TestStopWritesCheckpoint: Options.Stop closed between steps (after the
// log line of step 5) ends the run with a checkpoint of step 5; closed
// during step 8 (before its second row), the step is abandoned and step 7
// is saved. Each resumes to the uninterrupted run's losses and final
// weights bit for bit.
func TestStopWritesCheckpoint(t *testing.T) {
	b := testCache(t)
	over := []string{"log.every=1", "checkpoint.every=100", "eval.every=0"}
	full, err := Run(tinyConfig(t, b, filepath.Join(t.TempDir(), "full"), over...), Options{Log: io.Discard})
	if err != nil {
		t.Fatal(err)
	}
	check := func(name, runDir string, step int) {
		t.Helper()
		if ck, _ := LatestCheckpoint(runDir); ck != checkpointDir(runDir, step) {
			t.Fatalf("%s: newest checkpoint %q, want step %d", name, ck, step)
		}
		rest, err := Run(tinyConfig(t, b, runDir, over...), Options{Log: io.Discard})
		if err != nil {
			t.Fatal(err)
		}
		if len(rest.Steps) != 12-step {
			t.Fatalf("%s: resumed run ran %d steps, want %d", name, len(rest.Steps), 12-step)
		}
		for _, s := range rest.Steps {
			if w := full.Steps[s.Step-1]; s.Loss != w.Loss || s.GradNorm != w.GradNorm {
				t.Fatalf("%s: step %d after resume: loss %.17g, uninterrupted %.17g", name, s.Step, s.Loss, w.Loss)
			}
		}
		x, _ := os.ReadFile(filepath.Join(full.Checkpoint, "model.safetensors"))
		y, _ := os.ReadFile(filepath.Join(rest.Checkpoint, "model.safetensors"))
		if len(x) == 0 || !bytes.Equal(x, y) {
			t.Fatalf("%s: final weights differ from the uninterrupted run's", name)
		}
		if steps := metricSteps(t, runDir); len(steps) != 12 {
			t.Fatalf("%s: metrics steps %v", name, steps)
		}
	}

	// Between steps: the progress line of step 5 is written after its update.
	runDir := filepath.Join(t.TempDir(), "between")
	w := &stopAtLine{at: "step 5/12 ", stop: make(chan struct{})}
	res, err := Run(tinyConfig(t, b, runDir, over...), Options{Log: w, Stop: w.stop})
	if err != nil {
		t.Fatal(err)
	}
	if !res.Interrupted || res.Step != 5 || len(res.Steps) != 5 || res.Checkpoint != checkpointDir(runDir, 5) {
		t.Fatalf("stopped after step 5: interrupted %v step %d, %d steps, checkpoint %q\n%s", res.Interrupted, res.Step, len(res.Steps), res.Checkpoint, w.buf.String())
	}
	check("between steps", runDir, 5)

	// Mid-step: step 8 has several rows; stop before its second.
	runDir = filepath.Join(t.TempDir(), "mid")
	stop := make(chan struct{})
	rows := 0
	testHookRow = func(step, row int) {
		if step == 8 {
			rows++
			if row == 1 {
				close(stop)
			}
		}
	}
	defer func() { testHookRow = nil }()
	var log strings.Builder
	res, err = Run(tinyConfig(t, b, runDir, over...), Options{Log: &log, Stop: stop})
	testHookRow = nil
	if err != nil {
		t.Fatal(err)
	}
	if rows < 2 || !res.Interrupted || res.Step != 7 || len(res.Steps) != 7 || !strings.Contains(log.String(), "step 8 abandoned") {
		t.Fatalf("stopped during step 8 (row hook ran %d times): interrupted %v step %d, %d steps\n%s", rows, res.Interrupted, res.Step, len(res.Steps), log.String())
	}
	check("mid-step", runDir, 7)
}

// TestRunDirLock: a second trainer on a run directory in use is refused,
// naming the holder; once the first ends, the directory is free.
func TestRunDirLock(t *testing.T) {
	b := testCache(t)
	runDir := t.TempDir()
	l, err := lockRunDir(runDir)
	if err != nil {
		t.Fatal(err)
	}
	_, err = Run(tinyConfig(t, b, runDir, "train.max_steps=3"), Options{Log: io.Discard})
	if !errors.Is(err, ErrLocked) || !strings.Contains(err.Error(), fmt.Sprintf("pid %d", os.Getpid())) {
		t.Fatalf("second trainer on a locked run_dir: %v", err)
	}
	if ck, _ := LatestCheckpoint(runDir); ck != "" {
		t.Fatalf("the refused trainer wrote %s", ck)
	}
	l.unlock()
	if _, err := Run(tinyConfig(t, b, runDir, "train.max_steps=3"), Options{Log: io.Discard}); err != nil {
		t.Fatalf("after the holder let go: %v", err)
	}
	// A trainer in the middle of its run holds the lock too.
	runDir = t.TempDir()
	inRun := make(chan struct{})
	release := make(chan struct{})
	testHookRow = func(step, row int) {
		if step == 2 && row == 0 {
			close(inRun)
			<-release
		}
	}
	defer func() { testHookRow = nil }()
	done := make(chan error, 1)
	go func() {
		_, err := Run(tinyConfig(t, b, runDir, "train.max_steps=3"), Options{Log: io.Discard})
		done <- err
	}()
	<-inRun
	_, err = Run(tinyConfig(t, b, runDir, "train.max_steps=3"), Options{Log: io.Discard})
	close(release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if !errors.Is(err, ErrLocked) {
		t.Fatalf("second trainer while the first runs: %v", err)
	}
}

// TestSkippedStepsInMetrics: with a learning rate that blows the weights
// up after step 1, every later update is skipped: each skipped step is a
// metrics.jsonl line with null loss and "skipped": true, and the run
// stops after train.max_skipped_steps of them with ErrDiverged naming the
// last good checkpoint, which checkpoint retention kept.
func TestSkippedStepsInMetrics(t *testing.T) {
	b := testCache(t)
	runDir := t.TempDir()
	res, err := Run(tinyConfig(t, b, runDir, "optim.lr=1e30", "optim.min_lr=0", "optim.warmup_steps=0", "optim.lr_schedule=constant",
		"optim.max_grad_norm=0", "train.max_steps=40", "train.max_skipped_steps=4", "checkpoint.every=1", "checkpoint.keep=2", "eval.every=0"), Options{Log: io.Discard})
	if !errors.Is(err, ErrDiverged) {
		t.Fatalf("want ErrDiverged, got %v (%d steps)", err, len(res.Steps))
	}
	var good int
	for _, s := range res.Steps {
		if !s.Skipped {
			good = s.Step
		}
	}
	n := len(res.Steps)
	if good == 0 || n != good+4 {
		t.Fatalf("steps %d, last good %d: want the run to stop 4 skipped steps after the last good one", n, good)
	}
	want := checkpointDir(runDir, good)
	if !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), "train.max_skipped_steps 4") {
		t.Fatalf("error should name %s and the key: %v", want, err)
	}
	if _, err := os.Stat(want); err != nil {
		t.Fatalf("the last good checkpoint was not kept: %v", err)
	}
	f, err := os.ReadFile(filepath.Join(runDir, "metrics.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	var lines []map[string]any
	sc := bufio.NewScanner(bytes.NewReader(f))
	for sc.Scan() {
		var l map[string]any
		if err := json.Unmarshal(sc.Bytes(), &l); err != nil {
			t.Fatalf("metrics line %q: %v", sc.Text(), err)
		}
		lines = append(lines, l)
	}
	if len(lines) != n {
		t.Fatalf("metrics.jsonl has %d lines for %d steps:\n%s", len(lines), n, f)
	}
	last := lines[n-1]
	if last["skipped"] != true || last["grad_norm"] != nil || last["step"] != float64(n) {
		t.Fatalf("skipped step's line: %v", last)
	}
	if _, ok := last["grad_norm"]; !ok {
		t.Fatalf("a skipped step's grad_norm should be null, not absent: %v", last)
	}
}

// TestIntegerKeysAreStrict: 40.5 for an integer key is an error naming the
// key (yaml.v3 would truncate it), in a file and in an override; negative
// architecture sizes are errors.
func TestIntegerKeysAreStrict(t *testing.T) {
	p := filepath.Join(t.TempDir(), "c.yaml")
	os.WriteFile(p, []byte("run_dir: x\nmodel:\n  init_from: y\ndata:\n  cache: [z]\n  eval_range: [0, 8]\ntrain:\n  max_steps: 40.5\n"), 0o644)
	if _, err := LoadConfig(p, nil); !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "train.max_steps") || !strings.Contains(err.Error(), "40.5") || !strings.Contains(err.Error(), "line 8") {
		t.Fatalf("max_steps: 40.5: %v", err)
	}
	os.WriteFile(p, []byte("run_dir: x\nmodel:\n  init_from: y\ndata:\n  cache: [z]\n"), 0o644)
	for over, want := range map[string]string{
		"data.seq_len=1e3":           "data.seq_len",
		"data.eval_range=[0, 2.5]":   "data.eval_range[1]",
		"seed=1.5":                   "seed",
		"checkpoint.every=true":      "checkpoint.every",
		"train.max_steps=-5":         "train.max_steps",
		"train.max_skipped_steps=-1": "train.max_skipped_steps",
		"model.init_from=":           "model",
	} {
		if _, err := LoadConfig(p, []string{over}); !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: %v", over, err)
		}
	}
	if c, err := LoadConfig(p, []string{"train.max_steps=40", "data.eval_range=[0, 3]"}); err != nil || c.Train.MaxSteps != 40 {
		t.Fatalf("integers: %v", err)
	}
	os.WriteFile(p, []byte("run_dir: x\nmodel:\n  random: {arch: qwen3}\ndata:\n  cache: [z]\n"), 0o644)
	for over, want := range map[string]string{
		"model.random.hidden_size=12.0":     "model.random.hidden_size",
		"model.random.hidden_size=-5":       "model.random.hidden_size",
		"model.random.vocab_size=-1":        "model.random.vocab_size",
		"model.random.num_hidden_layers=-2": "model.random.num_hidden_layers",
		"model.random.init_std=-0.1":        "model.random.init_std",
	} {
		if _, err := LoadConfig(p, []string{over}); !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: %v", over, err)
		}
	}
}

// TestResumeRefusesOtherArchitecture: resuming with a changed
// architecture is refused naming the key, as a changed seq_len is.
func TestResumeRefusesOtherArchitecture(t *testing.T) {
	b := testCache(t)
	runDir := t.TempDir()
	if _, err := Run(tinyConfig(t, b, runDir, "train.max_steps=3"), Options{Log: io.Discard}); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct{ set, want string }{
		{"model.random.hidden_size=64", "model.random.hidden_size = 64"},
		{"model.random.num_hidden_layers=3", "model.random.num_hidden_layers = 3"},
		{"model.random.arch=llama", "model.random.arch"},
		{"model.random.rope_theta=5000", "model.random.rope_theta"},
		{"model.random.tie_word_embeddings=true", "model.random.tie_word_embeddings"},
	} {
		_, err := Run(tinyConfig(t, b, runDir, "train.max_steps=4", c.set), Options{Log: io.Discard})
		if !errors.Is(err, ErrResume) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("resume with %s: %v", c.set, err)
		}
	}
	// The same architecture resumes (init_seed and init_std do not change it).
	if _, err := Run(tinyConfig(t, b, runDir, "train.max_steps=4", "model.random.init_seed=9"), Options{Log: io.Discard}); err != nil {
		t.Fatal(err)
	}
	// init_from: the directory's config.json is compared.
	initDir := t.TempDir()
	mc, err := tinyConfig(t, b, runDir).Model.Random.ModelConfig()
	if err != nil {
		t.Fatal(err)
	}
	if err := model.WriteCheckpoint(initDir, mc, model.Init(mc, model.InitOptions{Seed: 1}), "F32"); err != nil {
		t.Fatal(err)
	}
	runDir = t.TempDir()
	if _, err := Run(tinyConfig(t, b, runDir, "train.max_steps=3", "model.random=null", "model.init_from="+initDir), Options{Log: io.Discard}); err != nil {
		t.Fatal(err)
	}
	mc.Intermediate = 96
	if err := model.WriteCheckpoint(initDir, mc, model.Init(mc, model.InitOptions{Seed: 1}), "F32"); err != nil {
		t.Fatal(err)
	}
	_, err = Run(tinyConfig(t, b, runDir, "train.max_steps=4", "model.random=null", "model.init_from="+initDir), Options{Log: io.Discard})
	if !errors.Is(err, ErrResume) || !strings.Contains(err.Error(), "model.init_from") || !strings.Contains(err.Error(), "intermediate_size = 96") {
		t.Fatalf("resume after init_from's architecture changed: %v", err)
	}
}

// TestNoOpRunKeepsRunDir: a resume of a finished run changes nothing in
// the run directory, config.yaml included, even with other overrides.
func TestNoOpRunKeepsRunDir(t *testing.T) {
	b := testCache(t)
	runDir := t.TempDir()
	if _, err := Run(tinyConfig(t, b, runDir, "train.max_steps=3"), Options{Log: io.Discard}); err != nil {
		t.Fatal(err)
	}
	snap := func() map[string]string {
		out := map[string]string{}
		filepath.Walk(runDir, func(p string, fi os.FileInfo, err error) error {
			if err == nil && !fi.IsDir() && fi.Name() != "train.lock" {
				c, _ := os.ReadFile(p)
				out[p] = string(c)
			}
			return nil
		})
		return out
	}
	before := snap()
	var log strings.Builder
	res, err := Run(tinyConfig(t, b, runDir, "train.max_steps=3", "log.every=3", "optim.weight_decay=0.5"), Options{Log: &log})
	if err != nil || len(res.Steps) != 0 || !strings.Contains(log.String(), "nothing to do") {
		t.Fatalf("no-op run: %v, %d steps\n%s", err, len(res.Steps), log.String())
	}
	// A lower max_steps trains nothing either: it said "resume: the
	// schedule changed ... the loss curve leaves the uninterrupted run's
	// from here" before "nothing to do".
	log.Reset()
	res, err = Run(tinyConfig(t, b, runDir, "train.max_steps=2", "optim.warmup_steps=1"), Options{Log: &log})
	if err != nil || len(res.Steps) != 0 || !strings.Contains(log.String(), "nothing to do") || strings.Contains(log.String(), "schedule changed") {
		t.Fatalf("no-op run with a lower train.max_steps: %v, %d steps; want only \"nothing to do\":\n%s", err, len(res.Steps), log.String())
	}
	after := snap()
	if len(after) != len(before) {
		t.Fatalf("no-op run changed the files of the run dir: %d -> %d", len(before), len(after))
	}
	for p, c := range before {
		if after[p] != c {
			t.Fatalf("no-op run rewrote %s", p)
		}
	}
}

// TestTokenizerDirMustMatchFingerprint: model.tokenizer and
// model.tokenizer_fingerprint that name different tokenizers are an
// error naming both; when they agree, the run records the directory.
func TestTokenizerDirMustMatchFingerprint(t *testing.T) {
	b := testCache(t)
	tok := t.TempDir()
	writeByteTokenizer(t, tok)
	_, err := Run(tinyConfig(t, b, t.TempDir(), "model.tokenizer="+tok), Options{Log: io.Discard})
	if !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "testcache-tokenizer") || !strings.Contains(err.Error(), "model.tokenizer "+tok) {
		t.Fatalf("model.tokenizer disagreeing with tokenizer_fingerprint: %v", err)
	}
}

// writeByteTokenizer writes a byte-level BPE tokenizer.json of the 256
// byte tokens (GPT-2's byte-to-unicode map) and one merge.
func writeByteTokenizer(t testing.TB, dir string) {
	t.Helper()
	vocab := map[string]int{}
	n := 0
	for b := 0; b < 256; b++ {
		r := rune(b)
		if !(b >= '!' && b <= '~' || b >= 0xA1 && b <= 0xAC || b >= 0xAE && b <= 0xFF) {
			r = rune(256 + n)
			n++
		}
		vocab[string(r)] = b
	}
	vocab["ab"] = 256
	js, _ := json.Marshal(map[string]any{
		"model":         map[string]any{"type": "BPE", "vocab": vocab, "merges": []string{"a b"}},
		"pre_tokenizer": map[string]any{"type": "ByteLevel", "add_prefix_space": false, "use_regex": true},
		"decoder":       map[string]any{"type": "ByteLevel"},
	})
	if err := os.WriteFile(filepath.Join(dir, "tokenizer.json"), js, 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestResumeDamagedCheckpoint: a newest checkpoint whose files are damaged
// (truncated weights, a missing optimizer file, a torn state.json)
// stopped the resume with the file's error alone, and an export or eval
// of the run said "cannot resume" too. The resume now names the
// checkpoint before it and the command that moves the damaged one aside,
// after which the same run resumes from it; with no earlier checkpoint it
// says so. An export names the earlier checkpoint, not a resume. The
// missing optimizer file is named, not the temporary link to it.
func TestResumeDamagedCheckpoint(t *testing.T) {
	b := testCache(t)
	runDir := t.TempDir()
	over := []string{"checkpoint.every=2", "checkpoint.keep=3", "eval.every=0", "optim.warmup_steps=1"}
	cfg := func(steps int) *Config {
		return tinyConfig(t, b, runDir, append([]string{fmt.Sprintf("train.max_steps=%d", steps)}, over...)...)
	}
	if _, err := Run(cfg(4), Options{Log: io.Discard}); err != nil {
		t.Fatal(err)
	}
	ck2, ck4 := checkpointDir(runDir, 2), checkpointDir(runDir, 4)
	w := filepath.Join(ck4, "model.safetensors")
	fi, _ := os.Stat(w)
	if err := os.Truncate(w, fi.Size()/2); err != nil {
		t.Fatal(err)
	}
	aside := filepath.Join(runDir, "step-00000004.damaged")
	_, err := Run(cfg(6), Options{Log: io.Discard})
	want := "checkpoint " + ck4 + " is damaged (a file missing, truncated or changed since it was saved); to resume from the one before it, " + ck2 + ", move it out of checkpoints/ (mv " + ck4 + " " + aside + ") and run the same command again"
	if !errors.Is(err, ErrResume) || !strings.Contains(err.Error(), "truncated file?") || !strings.HasSuffix(err.Error(), want) {
		t.Fatalf("resume from a truncated checkpoint: %v\nwant ErrResume ending %q", err, want)
	}
	_, _, err = LoadStudent(runDir)
	if err == nil || strings.Contains(err.Error(), "cannot resume") || !strings.Contains(err.Error(), "the run's checkpoint before it: --checkpoint "+ck2) {
		t.Fatalf("LoadStudent (export, eval) of the damaged checkpoint: %v", err)
	}
	if err := os.Rename(ck4, aside); err != nil {
		t.Fatal(err)
	}
	res, err := Run(cfg(6), Options{Log: io.Discard})
	if err != nil || res.Resumed != ck2 {
		t.Fatalf("the run after moving the damaged checkpoint aside: %v, resumed from %q, want %s", err, res.Resumed, ck2)
	}

	ck6 := checkpointDir(runDir, 6)
	os.Remove(filepath.Join(ck6, "optimizer.safetensors"))
	_, err = Run(cfg(8), Options{Log: io.Discard})
	if !errors.Is(err, ErrResume) || !strings.Contains(err.Error(), filepath.Join(ck6, "optimizer.safetensors")) || strings.Contains(err.Error(), "distill-opt-") ||
		!strings.Contains(err.Error(), "to resume from the one before it, "+checkpointDir(runDir, 4)) {
		t.Fatalf("resume without optimizer.safetensors: %v", err)
	}

	only := t.TempDir()
	if _, err := Run(tinyConfig(t, b, only, "train.max_steps=2", "checkpoint.every=2", "eval.every=0", "optim.warmup_steps=1"), Options{Log: io.Discard}); err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(checkpointDir(only, 2), "state.json"), []byte("{"), 0o644)
	_, err = Run(tinyConfig(t, b, only, "train.max_steps=4", "checkpoint.every=2", "eval.every=0", "optim.warmup_steps=1"), Options{Log: io.Discard})
	if !errors.Is(err, ErrResume) || !strings.HasSuffix(err.Error(), "and it is the run's only one: restore it from a copy, or start over in a new run_dir (--run-dir)") {
		t.Fatalf("resume from the only checkpoint, damaged: %v", err)
	}
}

// TestRunDirCannotBeMade: a run_dir that cannot be made said only "mkdir
// DIR: not a directory" or "mkdir DIR: permission denied", naming neither
// the setting nor the path at fault.
func TestRunDirCannotBeMade(t *testing.T) {
	b := testCache(t)
	file := filepath.Join(t.TempDir(), "notes.txt")
	os.WriteFile(file, []byte("x"), 0o644)
	ro := testdirs.Unwritable(t)
	give := ": give a directory this process can create and write (run_dir, or student train --run-dir)"
	for _, c := range []struct{ dir, want string }{
		{file, "run_dir " + file + ": " + file + " is a file, not a directory" + give},
		{filepath.Join(file, "run"), "run_dir " + filepath.Join(file, "run") + ": " + file + " is a file, not a directory" + give},
		{filepath.Join(ro, "run"), "run_dir " + filepath.Join(ro, "run") + ": cannot create " + filepath.Join(ro, "run") + " ("},
	} {
		_, err := Run(tinyConfig(t, b, c.dir, "train.max_steps=1", "optim.warmup_steps=0"), Options{Log: io.Discard})
		if err == nil || !strings.HasPrefix(err.Error(), c.want) || !strings.HasSuffix(err.Error(), give) {
			t.Errorf("run_dir %s: %v\nwant %s...%s", c.dir, err, c.want, give)
		}
	}
}
