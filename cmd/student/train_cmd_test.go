package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"distill/cache"
	"distill/compute/device"
	"distill/infer"
	"distill/train/testcache"
	"distill/train/trainer"
)

// TestTrainEvalExport drives the three subcommands on a real cache: train
// from a config with flag overrides (QAD on), eval the run, export BF16 and
// NVFP4 (files in place; their numerics are tested in package train); the
// BF16 export loads into the teacher forward and scores a cached sample.
func TestTrainEvalExport(t *testing.T) {
	dir := t.TempDir()
	b := sigCache(t, dir)
	cfg := filepath.Join(dir, "run.yaml")
	os.WriteFile(cfg, []byte(`run_dir: unused
model:
  random: {arch: qwen3, vocab_size: 97, hidden_size: 32, num_hidden_layers: 1, num_attention_heads: 2,
           num_key_value_heads: 1, head_dim: 16, intermediate_size: 64, max_position_embeddings: 128}
  tokenizer_fingerprint: testcache-tokenizer
data: {cache: [nowhere], seq_len: 64, global_batch_tokens: 128, eval_range: [0, 8]}
optim: {lr: 3e-3, min_lr: 3e-4, warmup_steps: 1}
train: {max_steps: 6, threads: 2}
checkpoint: {every: 3}
log: {progress: "off"}
quant: nvfp4
calib_batches: 2
`), 0o644)
	run := filepath.Join(dir, "run")
	if err := runTrain([]string{"--config", cfg, "--run-dir", run, "--cache", b.CacheDir, "--set", "eval.every=3"}); err != nil {
		t.Fatal(err)
	}
	if err := runTrain([]string{"--config", cfg, "--run-dir", run, "--cache", b.CacheDir, "--resume", "never"}); !errors.Is(err, trainer.ErrResume) {
		t.Fatalf("--resume never on a finished run: %v", err)
	}
	if err := runEval([]string{"--checkpoint", run, "--config", cfg, "--cache", b.CacheDir, "--range", "0:8"}); err != nil {
		t.Fatal(err)
	}
	if err := runEval([]string{"--checkpoint", run, "--cache", b.CacheDir, "--tokenizer-fingerprint", "other"}); err == nil || !strings.Contains(err.Error(), "other") {
		t.Fatalf("eval with another tokenizer: %v", err)
	}
	bf := filepath.Join(dir, "bf16")
	if err := runExport([]string{"--checkpoint", run, "--out", bf}); err != nil {
		t.Fatal(err)
	}
	fp4 := filepath.Join(dir, "nvfp4")
	if err := runExport([]string{"--checkpoint", run, "--out", fp4, "--format", "nvfp4"}); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"model.safetensors", "config.json", "hf_quant_config.json"} {
		if _, err := os.Stat(filepath.Join(fp4, f)); err != nil {
			t.Fatal(err)
		}
	}
	// The BF16 export is a teacher checkpoint: its log-probs are finite and
	// normalized, and it scores the cache's samples.
	tm, err := infer.Load(bf, device.CPU(0))
	if err != nil {
		t.Fatal(err)
	}
	rd, _ := cache.OpenReader(b.CacheDir)
	smp, _ := rd.Get(3)
	res, err := tm.TopK([][]int32{smp.Tokens}, infer.Options{K: 97})
	if err != nil {
		t.Fatal(err)
	}
	var z float64
	for _, lp := range res[0].LogProbs[:97] {
		z += math.Exp(float64(lp))
	}
	if math.Abs(z-1) > 1e-4 {
		t.Fatalf("exported model's probabilities sum to %g", z)
	}
	// A plain (non-QAD) student cannot be exported as NVFP4.
	if err := runExport([]string{"--checkpoint", bf, "--out", filepath.Join(dir, "x"), "--format", "nvfp4"}); err == nil || !strings.Contains(err.Error(), "quant: nvfp4") {
		t.Fatalf("nvfp4 export of a BF16 model: %v", err)
	}
}

// TestTrainDatasetExport: `student train --dataset` fine-tunes on a
// JSONL file with the student's tokenizer (no teacher, no cache);
// `student eval --config` on the run's config scores the held-out dataset
// samples as the run's own eval did; the run exports to an HF checkpoint
// with that tokenizer, which the teacher code loads.
func TestTrainDatasetExport(t *testing.T) {
	dir := t.TempDir()
	tok := filepath.Join(dir, "tok")
	os.MkdirAll(tok, 0o755)
	writeByteTokenizer(t, tok)
	file := filepath.Join(dir, "sft.jsonl")
	var recs strings.Builder
	for i := 0; i < 40; i++ {
		fmt.Fprintf(&recs, "{\"prompt\": \"What is %d plus %d?\", \"response\": \"%d.\"}\n", i, 2*i, 3*i)
	}
	os.WriteFile(file, []byte(recs.String()), 0o644)
	cfg := filepath.Join(dir, "sft.yaml")
	os.WriteFile(cfg, []byte(`run_dir: unused
model:
  random: {arch: qwen3, vocab_size: 257, hidden_size: 32, num_hidden_layers: 1, num_attention_heads: 2,
           num_key_value_heads: 1, head_dim: 16, intermediate_size: 64, max_position_embeddings: 128}
  tokenizer: `+tok+`
data: {dataset: {files: [nowhere.jsonl]}, seq_len: 64, global_batch_tokens: 128, eval_range: [0, 8]}
optim: {lr: 3e-3, min_lr: 3e-4, warmup_steps: 1}
train: {max_steps: 4, threads: 2}
log: {progress: "off"}
`), 0o644)
	run := filepath.Join(dir, "run")
	if err := runTrain([]string{"--config", cfg, "--run-dir", run, "--cache", dir}); err == nil || !strings.Contains(err.Error(), "set only one of data.cache") {
		t.Fatalf("--cache over a dataset config: %v", err)
	}
	if err := runTrain([]string{"--config", cfg, "--run-dir", run, "--dataset", file}); err != nil {
		t.Fatal(err)
	}
	// `student eval` on the config's dataset scores the held-out samples
	// exactly as the run's final eval did.
	evalLine := lastEval(t, run)
	m, _ := evalJSON(t, "--checkpoint", run, "--config", filepath.Join(run, "config.yaml"))
	if m["ce"] != evalLine.CE || int(m["tokens"].(float64)) != evalLine.Tokens || evalLine.Tokens == 0 || m["samples"] != 8.0 || m["kd"] != 0.0 {
		t.Fatalf("student eval on the dataset: %v; the run's final eval: %+v", m, evalLine)
	}
	out := filepath.Join(dir, "bf16")
	if err := runExport([]string{"--checkpoint", run, "--out", out}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(out, "tokenizer.json")); err != nil {
		t.Fatalf("export lacks the run's tokenizer: %v", err)
	}
	tm, err := infer.Load(out, device.CPU(0))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tm.TopK([][]int32{{87, 104, 97}}, infer.Options{K: 4}); err != nil {
		t.Fatal(err)
	}
}

// TestTrainDeviceError: a train.device that does not open is one
// sentence naming train.device, what is missing and the fix, exit 1 (a
// bad config); it read "student train: trainer: bad config: train.device
// cuda: ...", the trainer's sentinel in front of a whole sentence.
func TestTrainDeviceError(t *testing.T) {
	dir := t.TempDir()
	b, err := testcache.Build(testcache.Options{Dir: dir, Vocab: 97, K: 8, Samples: 16, Chunk: 16, MinLen: 6, MaxLen: 30, Seed: 2})
	if err != nil {
		t.Fatal(err)
	}
	cfg := filepath.Join(dir, "run.yaml")
	os.WriteFile(cfg, []byte(`model:
  random: {arch: qwen3, vocab_size: 97, hidden_size: 32, num_hidden_layers: 1, num_attention_heads: 2,
           num_key_value_heads: 1, head_dim: 16, intermediate_size: 64, max_position_embeddings: 128}
  tokenizer_fingerprint: testcache-tokenizer
data: {seq_len: 64, global_batch_tokens: 128}
train: {max_steps: 1, device: cuda}
log: {progress: "off"}
`), 0o644)
	t.Setenv("DISTILL_LIBCUDA", filepath.Join(dir, "libcuda.so.1"))
	var stderr strings.Builder
	code := commands.Run([]string{"train", "--config", cfg, "--run-dir", filepath.Join(dir, "run"), "--cache", b.CacheDir}, io.Discard, &stderr)
	line := strings.TrimSpace(stderr.String())
	if i := strings.LastIndex(line, "\n"); i >= 0 {
		line = line[i+1:]
	}
	if code != 1 || !strings.HasPrefix(line, "student train: train.device cuda: cannot load the CUDA driver: ") ||
		!strings.HasSuffix(line, "; without a GPU, set train.device: cpu") || strings.Contains(line, "bad config") {
		t.Errorf("train.device cuda without a driver: exit %d, last line\n%s", code, line)
	}
}

// TestEvalPretokenizedDataset: `student eval --config` on a run's config
// whose data.dataset is pre-tokenized needs no tokenizer, as the run
// did not (it demanded --tokenizer DIR): it scores the held-out samples
// exactly as the run's final eval did. An id past the student's
// vocab_size is an error naming the file, the line and the id; a
// --tokenizer, which such a dataset does not use, is refused.
func TestEvalPretokenizedDataset(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "ids.jsonl")
	var recs strings.Builder
	for i := 0; i < 24; i++ {
		ids := make([]string, 8+(i*5)%17)
		for j := range ids {
			ids[j] = fmt.Sprint((i*31 + j*7 + j*j) % 64)
		}
		fmt.Fprintf(&recs, "{\"input_ids\": [%s]}\n", strings.Join(ids, ", "))
	}
	os.WriteFile(file, []byte(recs.String()), 0o644)
	cfg := filepath.Join(dir, "sft.yaml")
	os.WriteFile(cfg, []byte(`run_dir: unused
model:
  random: {arch: qwen3, vocab_size: 64, hidden_size: 32, num_hidden_layers: 1, num_attention_heads: 2,
           num_key_value_heads: 1, head_dim: 16, intermediate_size: 64, max_position_embeddings: 128}
data: {dataset: {files: [`+file+`], pretokenized: true}, seq_len: 64, global_batch_tokens: 128, eval_range: [0, 8]}
optim: {lr: 3e-3, min_lr: 3e-4, warmup_steps: 1}
train: {max_steps: 2, threads: 2}
log: {progress: "off"}
`), 0o644)
	run := filepath.Join(dir, "run")
	if err := runTrain([]string{"--config", cfg, "--run-dir", run}); err != nil {
		t.Fatal(err)
	}
	evalLine := lastEval(t, run)
	m, _ := evalJSON(t, "--checkpoint", run, "--config", filepath.Join(run, "config.yaml"))
	if m["ce"] != evalLine.CE || int(m["tokens"].(float64)) != evalLine.Tokens || evalLine.Tokens == 0 || m["samples"] != 8.0 {
		t.Fatalf("student eval on the pre-tokenized dataset: %v; the run's final eval: %+v", m, evalLine)
	}
	err := runEval([]string{"--checkpoint", run, "--config", cfg, "--tokenizer", dir})
	if err == nil || !strings.Contains(err.Error(), "--tokenizer "+dir+": data.dataset is pre-tokenized") {
		t.Errorf("--tokenizer over a pre-tokenized dataset: %v", err)
	}

	// Line 3, held out, has id 64 under vocab_size 64.
	lines := strings.SplitAfter(recs.String(), "\n")
	lines[2] = "{\"input_ids\": [1, 2, 64]}\n"
	oov := filepath.Join(dir, "oov.jsonl")
	os.WriteFile(oov, []byte(strings.Join(lines, "")), 0o644)
	b, _ := os.ReadFile(cfg)
	oovCfg := filepath.Join(dir, "oov.yaml")
	os.WriteFile(oovCfg, []byte(strings.Replace(string(b), file, oov, 1)), 0o644)
	err = runEval([]string{"--checkpoint", run, "--config", oovCfg})
	if err == nil || !strings.Contains(err.Error(), "oov.jsonl:3: input_ids[2]: id out of vocab: token id 64 is outside [0, 64)") {
		t.Errorf("eval over an id past the student's vocab: %v; want the file, the line and the id", err)
	}
	// With skip_bad the record is not scored, and eval says so.
	skipCfg := filepath.Join(dir, "skip.yaml")
	os.WriteFile(skipCfg, []byte(strings.Replace(string(b), file+"], pretokenized: true", oov+"], pretokenized: true, skip_bad: true", 1)), 0o644)
	m, _ = evalJSON(t, "--checkpoint", run, "--config", skipCfg)
	if u, _ := m["unscored"].(map[string]any); m["samples"] != 7.0 || len(u) != 1 || u["id out of vocab"] != 1.0 {
		t.Errorf("eval with skip_bad over an id past the vocab: %v; want 7 samples scored, 1 unscored (id out of vocab)", m)
	}
	var out bytes.Buffer
	stdout = &out
	err = runEval([]string{"--checkpoint", run, "--config", skipCfg})
	stdout = os.Stdout
	if err != nil || !strings.Contains(out.String(), "dataset samples [0, 8) (7 scored, 1 not scored (id out of vocab: 1)), ") {
		t.Errorf("eval with skip_bad, text: %v\n%s", err, out.String())
	}
}

// evalRecord is what lastEval reads of an eval line of metrics.jsonl.
type evalRecord struct {
	CE     float64 `json:"ce"`
	Tokens int     `json:"tokens"`
}

// lastEval reads the last eval line of run's metrics.jsonl.
func lastEval(t *testing.T, run string) evalRecord {
	t.Helper()
	var e evalRecord
	mj, err := os.ReadFile(filepath.Join(run, "metrics.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(mj), "\n") {
		if strings.Contains(l, `"type":"eval"`) {
			json.Unmarshal([]byte(l), &e)
		}
	}
	return e
}

// The flags that stand for config keys pass their values as strings: a
// path is not YAML. "--run-dir 'out/run #2'" trained into out/run (the
// rest a YAML comment), "--run-dir 'a: b'" was a mapping, and a --cache
// or --dataset file with " #" or ": " in its name was not YAML at all.
func TestTrainFlagsAreStrings(t *testing.T) {
	dir := t.TempDir()
	cfg := filepath.Join(dir, "c.yaml")
	os.WriteFile(cfg, []byte("model: {random: {arch: qwen3}}\ndata: {cache: [x]}\n"), 0o644)
	for _, tc := range []struct {
		flag, val string
		got       func(c *trainer.Config) any
		want      any
	}{
		{"run-dir", "out/run #2", func(c *trainer.Config) any { return c.RunDir }, "out/run #2"},
		{"run-dir", "a: b", func(c *trainer.Config) any { return c.RunDir }, "a: b"},
		{"run-dir", "null", func(c *trainer.Config) any { return c.RunDir }, "null"},
		{"cache", "c #1, d: 2,[e]", func(c *trainer.Config) any { return fmt.Sprint(c.Data.Cache) }, "[c #1 d: 2 [e]]"},
		{"dataset", "f #1.jsonl,g.jsonl", func(c *trainer.Config) any { return fmt.Sprint(c.Data.Dataset.Files) }, "[f #1.jsonl g.jsonl]"},
	} {
		var sets []string
		switch tc.flag {
		case "run-dir":
			sets = flagSets(nil, map[string]bool{"run-dir": true}, tc.val, "", "", 0, 0, "")
		case "cache":
			sets = flagSets(nil, map[string]bool{"run-dir": true, "cache": true}, "r", tc.val, "", 0, 0, "")
		case "dataset":
			sets = flagSets([]string{"data.cache=null"}, map[string]bool{"run-dir": true, "dataset": true}, "r", "", tc.val, 0, 0, "")
		}
		c, err := trainer.LoadConfig(cfg, sets)
		if err != nil {
			t.Errorf("--%s %q: %v", tc.flag, tc.val, err)
			continue
		}
		if got := tc.got(c); got != tc.want {
			t.Errorf("--%s %q: config has %v, want %v", tc.flag, tc.val, got, tc.want)
		}
	}
}

// A config error that the dedicated flags may have caused names them as
// typed: "--max-steps 0" said "with --set train.max_steps=0", a flag the
// user never gave.
func TestTrainConfigErrorNamesFlags(t *testing.T) {
	dir := t.TempDir()
	cfg := filepath.Join(dir, "c.yaml")
	os.WriteFile(cfg, []byte("model: {random: {arch: qwen3}}\ndata: {cache: [x]}\n"), 0o644)
	run := filepath.Join(dir, "my run")
	err := runTrain([]string{"--config", cfg, "--set", "optim.lr=1e-3", "--run-dir", run, "--max-steps", "0"})
	want := cfg + ` with --set optim.lr=1e-3 --run-dir "` + run + `" --max-steps 0: train.max_steps: 0: want > 0`
	if err == nil || err.Error() != want {
		t.Errorf("--max-steps 0: %v\nwant %s", err, want)
	}
	err = runTrain([]string{"--set", "model.random.arch=qwen3", "--set", "data.cache=[x]", "--run-dir", run, "--threads", "-2"})
	want = `--set model.random.arch=qwen3 --set data.cache=[x] --run-dir "` + run + `" --threads -2: train.threads: -2: want >= 0`
	if err == nil || err.Error() != want {
		t.Errorf("no --config, --threads -2: %v\nwant %s", err, want)
	}
}

// TestTrainRefusesCacheOrModelRunDir: a run_dir that is a teacher cache
// (index/ and chunks/) or an HF model directory (config.json naming a
// model_type, model.safetensors) is refused before anything is written
// in it, naming what it is and a new directory: the run wrote its
// checkpoints/, config.yaml, metrics.jsonl and tb/ among their files.
// A directory that holds a run (checkpoints/) is still accepted: that is
// how a run resumes.
func TestTrainRefusesCacheOrModelRunDir(t *testing.T) {
	dir := t.TempDir()
	b := sigCache(t, dir)
	cfg := filepath.Join(dir, "run.yaml")
	os.WriteFile(cfg, []byte(strings.Replace(sigConfig, "max_steps: 1000000000", "max_steps: 2", 1)), 0o644)
	mdir := filepath.Join(dir, "model")
	if err := runInit([]string{"--out", mdir, "--vocab", "97", "--hidden", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--intermediate", "64", "--max-pos", "128"}); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ runDir, what string }{
		{b.CacheDir, "is a teacher cache (index/ and chunks/"},
		{mdir, "is an HF model directory (it holds config.json)"},
	} {
		before := dirNames(t, tc.runDir)
		err := runTrain([]string{"--config", cfg, "--run-dir", tc.runDir, "--cache", b.CacheDir})
		want := "run_dir " + tc.runDir + " " + tc.what
		if !errors.Is(err, trainer.ErrConfig) || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), "nothing was written") || !strings.Contains(err.Error(), "e.g. "+tc.runDir+"-run") {
			t.Errorf("train --run-dir %s: %v; want a config error with %q, saying nothing was written and naming a new directory", tc.runDir, err, want)
		}
		if after := dirNames(t, tc.runDir); !slices.Equal(before, after) {
			t.Errorf("train --run-dir %s refused, but it now holds %v (before: %v)", tc.runDir, after, before)
		}
	}
	run := filepath.Join(dir, "run")
	if err := runTrain([]string{"--config", cfg, "--run-dir", run, "--cache", b.CacheDir}); err != nil {
		t.Fatal(err)
	}
	if err := runTrain([]string{"--config", cfg, "--run-dir", run, "--cache", b.CacheDir, "--max-steps", "3", "--resume", "must"}); err != nil {
		t.Fatalf("resuming a run in its run directory: %v", err)
	}
}

// TestTrainEvalRangeAsWritten: the errors that name data.eval_range
// print it as a config writes it, [100, 200], not as Go prints a slice
// ([100 200]): a range past the cache, a range backwards, and a resume
// whose range is not the run's.
func TestTrainEvalRangeAsWritten(t *testing.T) {
	dir := t.TempDir()
	b := sigCache(t, dir) // 48 samples
	cfg := filepath.Join(dir, "run.yaml")
	os.WriteFile(cfg, []byte(strings.Replace(sigConfig, "max_steps: 1000000000", "max_steps: 1", 1)), 0o644)
	run := filepath.Join(dir, "run")
	for _, tc := range []struct{ set, want string }{
		{"data.eval_range=[100, 200]", "data.eval_range [100, 200] is past the cache's 48 samples"},
		{"data.eval_range=[20, 10]", "data.eval_range: [20, 10]: want [start, end) with 0 <= start < end"},
	} {
		err := runTrain([]string{"--config", cfg, "--run-dir", run, "--cache", b.CacheDir, "--set", tc.set})
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("train --set %s: %v; want %q", tc.set, err, tc.want)
		}
	}
	if err := runTrain([]string{"--config", cfg, "--run-dir", run, "--cache", b.CacheDir}); err != nil {
		t.Fatal(err)
	}
	err := runTrain([]string{"--config", cfg, "--run-dir", run, "--cache", b.CacheDir, "--max-steps", "2", "--set", "data.eval_range=[0, 16]"})
	if want := "was trained with data.eval_range = [0, 8], the config says [0, 16]"; err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("resume with another data.eval_range: %v; want %q", err, want)
	}
}
