package trainer

import (
	"bytes"
	"context"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"distill/model"
	"distill/serve"
)

// teacherModel writes a random Qwen3 teacher with vocab 260 (the byte
// tokenizer's 257 ids fit) and returns its directory.
func teacherModel(t testing.TB, hidden, layers int) string {
	t.Helper()
	dir := t.TempDir()
	cfg, err := model.Preset(model.ArchQwen3)
	if err != nil {
		t.Fatal(err)
	}
	cfg.VocabSize, cfg.Hidden, cfg.Layers, cfg.Intermediate, cfg.MaxPositions = 260, hidden, layers, 2*hidden, 256
	cfg.Heads, cfg.KVHeads, cfg.HeadDim = 4, 2, hidden/4
	if err := model.WriteCheckpoint(dir, cfg, model.Init(cfg, model.InitOptions{Seed: 5, Std: 0.5, Perturb: true}), "BF16"); err != nil {
		t.Fatal(err)
	}
	return dir
}

// teacherd is a daemon of the tests, on loopback, that can be killed and
// restarted on the same address.
type teacherd struct {
	t   testing.TB
	cfg serve.Config
	mu  sync.Mutex
	d   *serve.Daemon
}

func startTeacherd(t testing.TB, modelDir, tokDir, cacheDir, dataRoot string) *teacherd {
	t.Helper()
	td := &teacherd{t: t, cfg: serve.Config{Model: modelDir, Tokenizer: tokDir, Cache: cacheDir, Listen: "127.0.0.1:0", Metrics: "off", Device: "cpu", KMax: 16}}
	if dataRoot != "" {
		td.cfg.DataRoots = []string{dataRoot}
	}
	td.start()
	td.cfg.Listen = td.d.Addr() // a restart listens on the same address
	t.Cleanup(td.kill)
	return td
}

func (td *teacherd) start() {
	d, err := serve.Start(td.cfg, nil)
	if err != nil {
		td.t.Fatalf("teacherd: %v", err)
	}
	td.mu.Lock()
	td.d = d
	td.mu.Unlock()
}

// kill stops the daemon at once (in-flight streams are cut).
func (td *teacherd) kill() {
	td.mu.Lock()
	d := td.d
	td.d = nil
	td.mu.Unlock()
	if d != nil {
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		d.Shutdown(ctx)
	}
}

func (td *teacherd) addr() string { return td.cfg.Listen }

// onlineConfig is a tiny KD run on the byte dataset: online against
// addrs when given, else offline from cacheDir.
func onlineConfig(t *testing.T, tokDir, file, runDir, cacheDir string, addrs []string, over ...string) *Config {
	t.Helper()
	src := fmt.Sprintf("  dataset:\n    files: [%s]\n", file)
	dist := fmt.Sprintf("  teachers: [%s]\n  k: 4\n  chunk_samples: 8\n  prefetch: 8\n  teacher_timeout: 1m\n", strings.Join(addrs, ", "))
	if addrs == nil {
		src, dist = fmt.Sprintf("  cache: [%s]\n", cacheDir), ""
	}
	y := fmt.Sprintf(`run_dir: %s
seed: 3
model:
  random: {arch: qwen3, vocab_size: 260, hidden_size: 32, num_hidden_layers: 1, num_attention_heads: 4,
           num_key_value_heads: 2, head_dim: 8, intermediate_size: 64, max_position_embeddings: 256, init_seed: 1}
  tokenizer: %s
data:
%s  seq_len: 256
  global_batch_tokens: 300
  eval_range: [0, 8]
  shuffle_window: 2
distill:
  kd_weight: 1
  sft_weight: 0.2
%soptim: {lr: 3e-3, min_lr: 3e-4, lr_schedule: cosine, warmup_steps: 2, max_grad_norm: 1}
train: {max_steps: 8, threads: 1}
eval: {every: 4}
checkpoint: {every: 3, keep: 5}
log: {every: 4, progress: "off", tensorboard: false}
`, runDir, tokDir, src, dist)
	p := filepath.Join(t.TempDir(), "c.yaml")
	if err := os.WriteFile(p, []byte(y), 0o644); err != nil {
		t.Fatal(err)
	}
	cfg, err := LoadConfig(p, over)
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

// onlineFixture is a byte dataset and a teacher for it.
type onlineFixture struct {
	tokDir, file, teacher string
}

// newOnlineFixture writes n prompt/response records of 100 to 160
// bytes (tokens: a byte tokenizer). Samples this long keep the teacher's
// packs of any composition above the size where OpenBLAS switches to
// its small-matrix kernels, whose rounding depends on the pack: only
// then does a sample's top-k not depend on what teacherd packed it
// with, which the exactness test needs.
func newOnlineFixture(t *testing.T, n int) onlineFixture {
	t.Helper()
	dir := t.TempDir()
	tokDir := filepath.Join(dir, "tok")
	os.MkdirAll(tokDir, 0o755)
	writeByteTokenizer(t, tokDir)
	recs := arithRecords(n, 1)
	for i, r := range recs {
		r["prompt"] = strings.Repeat(r["prompt"].(string)+" ", 4+i%3)
	}
	file := filepath.Join(dir, "long.jsonl")
	writeJSONL(t, file, recs)
	return onlineFixture{tokDir: tokDir, file: file, teacher: teacherModel(t, 32, 1)}
}

// fillCache fills a lossless cache of the whole dataset through the
// daemon's Fill, chunked as the online configs are (8 samples).
func (f onlineFixture) fillCache(t *testing.T, td *teacherd, cfg *Config) string {
	t.Helper()
	opts, err := cfg.Data.Dataset.options(cfg.Data.SeqLen)
	if err != nil {
		t.Fatal(err)
	}
	spec, err := serve.DatasetSpec(cfg.Data.Dataset.sources(), opts, false)
	if err != nil {
		t.Fatal(err)
	}
	w, err := serve.Dial(td.addr(), serve.DialOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	if _, err := serve.RunFill(context.Background(), []serve.Worker{w}, serve.FillPlan{Dataset: spec, ChunkSamples: 8, K: 4, Encoding: "lossless"}); err != nil {
		t.Fatal(err)
	}
	return td.cfg.Cache
}

func run(t *testing.T, cfg *Config, o Options) (*Result, string) {
	t.Helper()
	var log bytes.Buffer
	o.Log = &log
	res, err := Run(cfg, o)
	if err != nil {
		t.Fatalf("%v\n%s", err, log.String())
	}
	return res, log.String()
}

// sameLosses fails unless a and b have bit-identical losses step for
// step and eval for eval.
func sameLosses(t *testing.T, what string, a, b *Result) {
	t.Helper()
	if len(a.Steps) != len(b.Steps) || len(a.Evals) != len(b.Evals) {
		t.Fatalf("%s: %d steps and %d evals vs %d and %d", what, len(a.Steps), len(a.Evals), len(b.Steps), len(b.Evals))
	}
	for i := range a.Steps {
		x, y := a.Steps[i], b.Steps[i]
		if math.Float64bits(x.Loss) != math.Float64bits(y.Loss) || math.Float64bits(x.KD) != math.Float64bits(y.KD) || x.Tokens != y.Tokens {
			t.Fatalf("%s: step %d: loss %v kd %v (%d tokens) vs loss %v kd %v (%d tokens)", what, x.Step, x.Loss, x.KD, x.Tokens, y.Loss, y.KD, y.Tokens)
		}
	}
	for i := range a.Evals {
		if math.Float64bits(a.Evals[i].Loss) != math.Float64bits(b.Evals[i].Loss) || a.Evals[i].Top1Agreement != b.Evals[i].Top1Agreement {
			t.Fatalf("%s: eval %d: %+v vs %+v", what, i, a.Evals[i], b.Evals[i])
		}
	}
}

// TestOnlineMatchesOffline is the exactness test: an online run and an
// offline run from a cache filled by the same teacher on the same data
// (lossless encoding) give identical losses step for step, and identical
// evals; the online run also has KD in its evals and logs its wait.
func TestOnlineMatchesOffline(t *testing.T) {
	f := newOnlineFixture(t, 60)
	td := startTeacherd(t, f.teacher, f.tokDir, filepath.Join(t.TempDir(), "cache"), filepath.Dir(f.file))
	on := onlineConfig(t, f.tokDir, f.file, filepath.Join(t.TempDir(), "online"), "", []string{td.addr()})
	cdir := f.fillCache(t, td, on)
	off := onlineConfig(t, f.tokDir, f.file, filepath.Join(t.TempDir(), "offline"), cdir, nil)
	ro, _ := run(t, off, Options{})
	rn, log := run(t, on, Options{})
	sameLosses(t, "online vs offline", rn, ro)
	if rn.Steps[0].KD == 0 || rn.Evals[0].KD == 0 {
		t.Fatalf("online run has no KD term: %+v %+v", rn.Steps[0], rn.Evals[0])
	}
	if !strings.Contains(log, "teachers: teacher t0: qwen3") {
		t.Errorf("log lacks the teacher line:\n%s", log)
	}
	b, err := os.ReadFile(filepath.Join(on.RunDir, "metrics.jsonl"))
	if err != nil || !strings.Contains(string(b), `"teacher_wait_s":`) || !strings.Contains(string(b), `"queue_depth":`) {
		t.Fatalf("metrics.jsonl lacks the wait and queue depth: %v\n%s", err, b)
	}
}
