package trainer

import (
	"fmt"

	"distill/cache"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// evalCacheConfig is an SFT run on f's dataset (the data settings of
// onlineConfig, which filled the cache) of a student that starts as the
// teacher (so that it agrees with the teacher's top-1 at first, and less
// as SFT moves it), with extra YAML lines appended.
func evalCacheConfig(t *testing.T, f onlineFixture, runDir, extra string) (*Config, error) {
	t.Helper()
	y := fmt.Sprintf(`run_dir: %s
seed: 3
model:
  init_from: %s
  tokenizer: %s
data:
  dataset:
    files: [%s]
  seq_len: 256
  global_batch_tokens: 300
  eval_range: [0, 8]
  shuffle_window: 2
optim: {lr: 3e-3, min_lr: 3e-4, lr_schedule: cosine, warmup_steps: 2, max_grad_norm: 1}
train: {max_steps: 6, threads: 1}
checkpoint: {every: 3, keep: 5}
log: {every: 4, progress: "off", tensorboard: false}
%s`, runDir, f.teacher, f.tokDir, f.file, extra)
	p := filepath.Join(t.TempDir(), "sft.yaml")
	if err := os.WriteFile(p, []byte(y), 0o644); err != nil {
		t.Fatal(err)
	}
	return LoadConfig(p, nil)
}

// TestEvalCache: an SFT run on a dataset with eval.cache (a teacher's
// cache of the same samples) trains exactly as without it, and its evals
// score the held-out samples against the teacher: top-1 agreement and KD,
// with the CE and accuracy the dataset's evals give. eval.cache beside a
// cache, without eval_range, or holding other samples than the dataset's
// held-out ones is an error naming the key.
func TestEvalCache(t *testing.T) {
	f := newOnlineFixture(t, 40)
	td := startTeacherd(t, f.teacher, f.tokDir, filepath.Join(t.TempDir(), "cache"), filepath.Dir(f.file))
	on := onlineConfig(t, f.tokDir, f.file, filepath.Join(t.TempDir(), "on"), "", []string{td.addr()})
	cdir := fillCache(t, td, on)

	plain, err := evalCacheConfig(t, f, filepath.Join(t.TempDir(), "plain"), "eval: {every: 3}\n")
	if err != nil {
		t.Fatal(err)
	}
	withCache, err := evalCacheConfig(t, f, filepath.Join(t.TempDir(), "cached"), fmt.Sprintf("eval: {every: 3, cache: %s}\n", cdir))
	if err != nil {
		t.Fatal(err)
	}
	rp, _ := run(t, plain, Options{})
	rc, log := run(t, withCache, Options{})
	if len(rp.Steps) != len(rc.Steps) || len(rp.Evals) != 2 || len(rc.Evals) != 2 {
		t.Fatalf("%d steps, %d evals vs %d steps, %d evals", len(rp.Steps), len(rp.Evals), len(rc.Steps), len(rc.Evals))
	}
	for i := range rp.Steps {
		if math.Float64bits(rp.Steps[i].Loss) != math.Float64bits(rc.Steps[i].Loss) {
			t.Fatalf("step %d: loss %v with eval.cache, %v without: the evals changed training", i+1, rc.Steps[i].Loss, rp.Steps[i].Loss)
		}
	}
	for i := range rc.Evals {
		p, c := rp.Evals[i], rc.Evals[i]
		if p.KD != 0 || p.Top1Agreement != 0 || !(c.KD > 0) || !(c.Top1Agreement > 0.2 && c.Top1Agreement <= 1) {
			t.Errorf("eval %d: KD %v, top-1 %v with eval.cache; %v, %v without: want the teacher's numbers only with it", i, c.KD, c.Top1Agreement, p.KD, p.Top1Agreement)
		}
		if c.Tokens != p.Tokens || c.Samples != p.Samples || math.Abs(c.CE-p.CE) > 1e-6*p.CE || c.TokenAccuracy != p.TokenAccuracy {
			t.Errorf("eval %d: CE %v, accuracy %v over %d tokens of %d samples from the cache; %v, %v, %d, %d from the dataset",
				i, c.CE, c.TokenAccuracy, c.Tokens, c.Samples, p.CE, p.TokenAccuracy, p.Tokens, p.Samples)
		}
	}
	// The last eval is what `student eval --cache` says of the final
	// checkpoint (the same samples, teacher and loss; the sums' last bits
	// may differ with OpenBLAS's kernel choice for the rows' shapes).
	s, _, err := LoadStudent(rc.Checkpoint)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Free()
	rd, err := cache.OpenReader(cdir)
	if err != nil {
		t.Fatal(err)
	}
	m := rd.Manifest()
	lo := withCache.LossOptions(float64(m.Temperature))
	want, err := Evaluate(s, rd, cache.Range{Start: 0, End: 8}, withCache.Data.SeqLen, withCache.Data.Truncate, &lo)
	if err != nil {
		t.Fatal(err)
	}
	if got := rc.Evals[1]; got.Top1Agreement != want.Top1Agreement || math.Abs(got.KD-want.KD) > 1e-6*want.KD || math.Abs(got.CE-want.CE) > 1e-6*want.CE {
		t.Errorf("the last eval: top-1 %v, KD %v, CE %v; Evaluate on the cache: %v, %v, %v", got.Top1Agreement, got.KD, got.CE, want.Top1Agreement, want.KD, want.CE)
	}
	t.Logf("last eval against the cache: top-1 %.4f, KD %.4f, CE %.4f", want.Top1Agreement, want.KD, want.CE)
	if !strings.Contains(log, "scored against its teacher") || !strings.Contains(log, "top1_agree") {
		t.Errorf("the log does not say the evals score against the cache's teacher:\n%s", log)
	}

	// A dataset whose held-out samples differ from the cache's (one
	// record changed, the rest as filled).
	recs := arithRecords(40, 1)
	for i, r := range recs {
		r["prompt"] = strings.Repeat(r["prompt"].(string)+" ", 8+i%4)
	}
	recs[3]["response"] = "something else entirely"
	other := f
	other.file = filepath.Join(t.TempDir(), "other.jsonl")
	writeJSONL(t, other.file, recs)
	ocfg, err := evalCacheConfig(t, other, filepath.Join(t.TempDir(), "other"), fmt.Sprintf("eval: {cache: %s}\n", cdir))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Run(ocfg, Options{Log: &strings.Builder{}}); err == nil || !strings.Contains(err.Error(), "eval.cache") || !strings.Contains(err.Error(), "differs from data.dataset") {
		t.Errorf("a cache of other samples: %v, want an error naming eval.cache and the differing samples", err)
	}
	// eval.cache on a cache run, or without data.eval_range.
	kd := onlineConfig(t, f.tokDir, f.file, filepath.Join(t.TempDir(), "kd"), cdir, nil)
	kd.Eval.Cache = cdir
	if err := kd.Validate(); err == nil || !strings.Contains(err.Error(), "eval.cache") {
		t.Errorf("eval.cache on a cache run: %v, want an error naming eval.cache", err)
	}
	noRange := *withCache
	noRange.Data.EvalRange = nil
	if err := noRange.Validate(); err == nil || !strings.Contains(err.Error(), "eval.cache") || !strings.Contains(err.Error(), "data.eval_range") {
		t.Errorf("eval.cache without data.eval_range: %v, want an error naming both", err)
	}
}
