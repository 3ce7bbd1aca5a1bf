package trainer

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"distill/cache"

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
	return startTeacherdBudget(t, modelDir, tokDir, cacheDir, dataRoot, 256)
}

// startTeacherdBudget starts a daemon with a forward pass of budget
// tokens (startTeacherd: 256, one sample of the fixtures per pass).
func startTeacherdBudget(t testing.TB, modelDir, tokDir, cacheDir, dataRoot string, budget int) *teacherd {
	t.Helper()
	td := &teacherd{t: t, cfg: serve.Config{Model: modelDir, Tokenizer: tokDir, Cache: cacheDir, Listen: "127.0.0.1:0", Metrics: "off", Device: "cpu", KMax: 16, TokenBudget: budget}}
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
	// A client retrying the dead address can hold the port for a moment
	// (a TCP self-connect of a dial to a port nobody listens on): bind
	// again until it is free. A count of tries would be a time in
	// disguise (a fast machine spends 1000 in a millisecond); the minute
	// is a watchdog.
	for deadline := time.Now().Add(time.Minute); err != nil && strings.Contains(err.Error(), "address already in use") && time.Now().Before(deadline); {
		time.Sleep(time.Millisecond)
		d, err = serve.Start(td.cfg, nil)
	}
	if err != nil {
		td.t.Errorf("teacherd: %v", err)
		return
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

// newOnlineFixture writes n prompt/response records of 150 to 250
// tokens (a byte tokenizer), more than half of the teachers' token
// budget (256, startTeacherd): every forward pass of teacherd then holds
// one sample, in a Fill as in Score. The CPU teacher's answer for a
// sample is bit-identical only between packs of the same composition
// (OpenBLAS's small-matrix kernels, which it uses for some GEMM shapes,
// round differently from its large ones, so a sample's rows can round
// differently with other companions), and which samples teacherd packs
// together depends on when they arrive: one sample per pass makes the
// answers independent of timing, which bit-exact comparisons need.
func newOnlineFixture(t *testing.T, n int) onlineFixture {
	t.Helper()
	dir := t.TempDir()
	tokDir := filepath.Join(dir, "tok")
	os.MkdirAll(tokDir, 0o755)
	writeByteTokenizer(t, tokDir)
	recs := arithRecords(n, 1)
	for i, r := range recs {
		r["prompt"] = strings.Repeat(r["prompt"].(string)+" ", 8+i%4)
	}
	file := filepath.Join(dir, "long.jsonl")
	writeJSONL(t, file, recs)
	return onlineFixture{tokDir: tokDir, file: file, teacher: teacherModel(t, 32, 1)}
}

// fillCache fills a lossless cache of the whole dataset of cfg through
// the daemon's Fill, chunked as the online configs are (8 samples), its
// records pre-tokenized where cfg's are (cachectl fill --pretokenized).
func fillCache(t testing.TB, td *teacherd, cfg *Config) string {
	t.Helper()
	opts, err := cfg.Data.Dataset.options(cfg.Data.SeqLen)
	if err != nil {
		t.Fatal(err)
	}
	spec, err := serve.DatasetSpec(cfg.Data.Dataset.sources(), opts, cfg.Data.Dataset.Pretokenized)
	if err != nil {
		t.Fatal(err)
	}
	w, err := serve.Dial(td.addr(), serve.DialOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	if _, err := serve.RunFill(context.Background(), []serve.Worker{w}, serve.FillPlan{Dataset: spec, ChunkSamples: cfg.Distill.ChunkSamples, K: int32(cfg.Distill.K), Encoding: "lossless"}); err != nil {
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
	cdir := fillCache(t, td, on)
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

// fastRetry makes replicas retry at once (the tests synchronize on
// hooks; the pacing only saves time) and clears the hooks afterwards.
func fastRetry(t *testing.T) {
	rmin, rmax := retryMin, retryMax
	retryMin, retryMax = 5*time.Millisecond, 20*time.Millisecond
	t.Cleanup(func() {
		retryMin, retryMax = rmin, rmax
		testHookAnswer, testHookPause = nil, nil
	})
}

// reference is an online run with no fault, for comparisons.
func (f onlineFixture) reference(t *testing.T, addr string, over ...string) *Result {
	t.Helper()
	res, _ := run(t, onlineConfig(t, f.tokDir, f.file, filepath.Join(t.TempDir(), "ref"), "", []string{addr}, over...), Options{})
	return res
}

// TestOnlineReplicaDiesAndReturns: of two replicas, a is killed after
// its 5th answer and its samples go to b; at b's 12th answer a is
// restarted and b killed: a, retried, takes all the work from there. No
// row is skipped or trained twice: the losses are bit-identical to a
// run without the faults.
func TestOnlineReplicaDiesAndReturns(t *testing.T) {
	fastRetry(t)
	f := newOnlineFixture(t, 40)
	a := startTeacherd(t, f.teacher, f.tokDir, "", "")
	b := startTeacherd(t, f.teacher, f.tokDir, "", "")
	ref := f.reference(t, a.addr(), "train.max_steps=14")
	var killed, restarted sync.Once
	var after atomic.Int64 // a's answers after its restart
	testHookAnswer = func(addr string, n int64) {
		switch {
		case addr == a.addr() && n == 5:
			killed.Do(a.kill)
		case addr == b.addr() && n == 12:
			restarted.Do(func() { a.start(); b.kill() })
		case addr == a.addr() && n > 5:
			after.Add(1)
		}
	}
	cfg := onlineConfig(t, f.tokDir, f.file, filepath.Join(t.TempDir(), "run"), "", []string{a.addr(), b.addr()}, "train.max_steps=14")
	res, log := run(t, cfg, Options{})
	sameLosses(t, "replica killed and restarted vs no fault", res, ref)
	if !strings.Contains(log, "replica "+a.addr()+" failed") || !strings.Contains(log, "go to the other replicas") {
		t.Errorf("log does not say that the replica failed and its samples moved:\n%s", log)
	}
	if after.Load() == 0 {
		t.Errorf("the restarted replica got no work")
	}
}

// TestOnlinePauseAndResume: the only teacher dies; training pauses with
// a log line, and resumes when it comes back; the losses are those of a
// run without the fault.
func TestOnlinePauseAndResume(t *testing.T) {
	fastRetry(t)
	f := newOnlineFixture(t, 40)
	a := startTeacherd(t, f.teacher, f.tokDir, "", "")
	ref := f.reference(t, a.addr())
	var killed sync.Once
	testHookAnswer = func(addr string, n int64) {
		if n == 7 {
			killed.Do(a.kill)
		}
	}
	testHookPause = func() { go a.start() } // restarted only once the run has paused
	res, log := run(t, onlineConfig(t, f.tokDir, f.file, filepath.Join(t.TempDir(), "run"), "", []string{a.addr()}), Options{})
	sameLosses(t, "paused and resumed vs no fault", res, ref)
	for _, want := range []string{"no replica of teacher t0 is reachable", "training paused", "giving up after distill.teacher_timeout 1m0s", "training resumes"} {
		if !strings.Contains(log, want) {
			t.Errorf("log lacks %q:\n%s", want, log)
		}
	}
}

// TestOnlineTimeoutCheckpointsAndResumes: the only teacher dies and
// stays down past distill.teacher_timeout: the run ends with ErrTeachers
// after checkpointing its last finished step; rerun with the teacher
// back, it resumes and ends where a run without the fault ends.
func TestOnlineTimeoutCheckpointsAndResumes(t *testing.T) {
	fastRetry(t)
	f := newOnlineFixture(t, 40)
	a := startTeacherd(t, f.teacher, f.tokDir, "", "")
	ref := f.reference(t, a.addr())
	var killed sync.Once
	testHookAnswer = func(addr string, n int64) {
		if n == 9 {
			killed.Do(a.kill)
		}
	}
	// 50 ms is the outage's timeout; the run's first Info check gets a
	// minute (a watchdog), or a loaded machine would fail it instead.
	testInfoTimeout = time.Minute
	defer func() { testInfoTimeout = 0 }()
	cfg := onlineConfig(t, f.tokDir, f.file, filepath.Join(t.TempDir(), "run"), "", []string{a.addr()}, "distill.teacher_timeout=50ms")
	var log bytes.Buffer
	res, err := Run(cfg, Options{Log: &log})
	if !errors.Is(err, ErrTeachers) || !strings.Contains(err.Error(), "teacher_timeout 50ms") || !strings.Contains(err.Error(), "rerun the same command to resume") {
		t.Fatalf("want ErrTeachers naming teacher_timeout, got %v\n%s", err, log.String())
	}
	if ck, _ := LatestCheckpoint(cfg.RunDir); res.Step > 0 && ck != checkpointDir(cfg.RunDir, res.Step) {
		t.Fatalf("step %d finished but the newest checkpoint is %q: %v", res.Step, ck, err)
	}
	testHookAnswer = nil
	a.start()
	cfg2 := onlineConfig(t, f.tokDir, f.file, cfg.RunDir, "", []string{a.addr()})
	res2, _ := run(t, cfg2, Options{})
	tail := &Result{Steps: ref.Steps[len(ref.Steps)-len(res2.Steps):], Evals: ref.Evals[len(ref.Evals)-len(res2.Evals):]}
	sameLosses(t, "resumed after the timeout vs no fault", res2, tail)
}

// TestOnlineWriteCache: a run writes every answer through to a cache;
// stopped after 5 steps (checkpoint at 3), the cache holds only whole
// chunks and passes Check; the resumed run reuses them (asks fewer
// samples than the whole order) and finishes as a run without stop; a
// new run on the full cache, and its second epoch, ask the teacher
// nothing and still give the same losses (lossless encoding).
func TestOnlineWriteCache(t *testing.T) {
	fastRetry(t)
	f := newOnlineFixture(t, 40)
	a := startTeacherd(t, f.teacher, f.tokDir, "", "")
	over := []string{"distill.write_encoding=lossless", "train.max_steps=20"} // 16 steps an epoch: 20 reach the second
	ref := f.reference(t, a.addr(), over...)
	wdir := filepath.Join(t.TempDir(), "wc")
	over = append(over, "distill.write_cache="+wdir)
	var asked atomic.Int64
	testHookAnswer = func(string, int64) { asked.Add(1) }
	cfg := onlineConfig(t, f.tokDir, f.file, filepath.Join(t.TempDir(), "run"), "", []string{a.addr()}, over...)
	run(t, cfg, Options{StopAfter: 5})
	rep, err := cache.Check(wdir, nil)
	if err != nil {
		t.Fatal(err)
	}
	if !rep.OK() {
		t.Fatalf("write cache fails Check: %+v", rep)
	}
	rd, err := cache.OpenReader(wdir)
	if err != nil {
		t.Fatal(err)
	}
	for _, ch := range rd.Chunks() {
		if ch.Start%8 != 0 || ch.End-ch.Start != 8 {
			t.Fatalf("chunk %v is not a whole chunk of 8", ch.Range)
		}
	}
	first := asked.Load()
	asked.Store(0)
	// How many samples the resumed run asks depends on how far its
	// prefetch runs ahead before the run ends; which ones it asks does
	// not: none of a chunk the write cache holds.
	reused := askedFrom(t, rd.Chunks())
	res, _ := run(t, cfg, Options{})
	reused(t)
	t.Logf("the first run asked %d samples, the resumed run %d", first, asked.Load())
	tail := &Result{Steps: ref.Steps[len(ref.Steps)-len(res.Steps):], Evals: ref.Evals[len(ref.Evals)-len(res.Evals):]}
	sameLosses(t, "resumed with the write cache vs no stop", res, tail)
	if rd, err = cache.OpenReader(wdir); err != nil || rd.Samples() != 40 {
		t.Fatalf("write cache after a whole epoch: %v samples, %v", rd.Samples(), err)
	}
	asked.Store(0)
	res, _ = run(t, onlineConfig(t, f.tokDir, f.file, filepath.Join(t.TempDir(), "run2"), "", []string{a.addr()}, over...), Options{})
	if asked.Load() != 0 {
		t.Errorf("a run on the full write cache asked the teacher %d samples, want 0", asked.Load())
	}
	sameLosses(t, "from the write cache vs asking", res, ref)
}

// TestOnlineConfig: distill.teachers in both forms, the defaults, and
// the errors naming the key: teachers with data.cache or without data.dataset, online keys
// without teachers, bad values.
func TestOnlineConfig(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "c.yaml")
	os.WriteFile(p, []byte("run_dir: x\nmodel:\n  init_from: y\ndata:\n  seq_len: 64\n  dataset:\n    files: [a.jsonl]\ndistill:\n  teachers: [h1:7070, h2:7070]\n"), 0o644)
	c, err := LoadConfig(p, nil)
	if err != nil {
		t.Fatal(err)
	}
	o := c.Distill.OnlineConfig
	if len(o.Teachers) != 1 || strings.Join(o.Teachers[0].Addrs, ",") != "h1:7070,h2:7070" || o.Teachers[0].Name != "t0" || o.Teachers[0].Weight != 1 {
		t.Fatalf("shorthand: %+v", o.Teachers)
	}
	if o.Prefetch != defaultPrefetch || o.ChunkSamples != 256 || o.TeacherTimeout != 10*time.Minute || o.WriteEncoding != "compact" || o.CaptureTemperature != 1 {
		t.Fatalf("defaults: %+v", o)
	}
	if c.Distill.KDWeight != 1 || c.Distill.SFTWeight != 0 {
		t.Fatalf("online KD keeps the KD loss defaults: kd_weight %g sft_weight %g", c.Distill.KDWeight, c.Distill.SFTWeight)
	}
	c, err = LoadConfig(p, []string{"distill.teachers=[{addrs: [h:1], name: big, weight: 2}]", "distill.teacher_timeout=30s"})
	if err != nil || c.Distill.Teachers[0].Name != "big" || c.Distill.Teachers[0].Weight != 2 || c.Distill.TeacherTimeout != 30*time.Second {
		t.Fatalf("long form: %+v %v", c, err)
	}
	for over, want := range map[string][]string{
		"distill.teachers=[{addrs: []}]":         {"distill.teachers[0].addrs", "empty"},
		"distill.teachers=['a:1,b:1']":           {"distill.teachers[0].addrs[0]", "one address per list item"},
		"distill.teachers=[a:1, {addrs: [b:1]}]": {"do not mix"},
		"distill.teachers=a:1":                   {"want a list"},
		"data.cache=[c]":                         {"only one of data.cache"},
		"distill.prefetch=-1":                    {"distill.prefetch", "-1"},
		"distill.k=-2":                           {"distill.k"},
		"distill.write_encoding=zip":             {"distill.write_encoding", "compact or lossless"},
		"distill.teacher_timeout=-1s":            {"distill.teacher_timeout"},
		"distill.capture_temperature=-1":         {"distill.capture_temperature"},
	} {
		_, err := LoadConfig(p, []string{over})
		if !errors.Is(err, ErrConfig) {
			t.Errorf("%s: want ErrConfig, got %v", over, err)
			continue
		}
		for _, w := range want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("%s: error %q lacks %q", over, err, w)
			}
		}
	}
	os.WriteFile(p, []byte("run_dir: x\nmodel:\n  init_from: y\ndata:\n  cache: [c]\ndistill:\n  teachers: [h1:7070]\n"), 0o644)
	if _, err := LoadConfig(p, nil); err == nil || !strings.Contains(err.Error(), "reads no cache: remove data.cache") {
		t.Errorf("teachers with data.cache: %v", err)
	}
	if _, err := LoadConfig(p, []string{"distill.teachers=null", "distill.write_cache=w"}); err == nil || !strings.Contains(err.Error(), "distill.write_cache: is for online KD and needs distill.teachers") {
		t.Errorf("write_cache without teachers: %v", err)
	}
	os.WriteFile(p, []byte("run_dir: x\nmodel:\n  init_from: y\ndata:\n  cache: []\ndistill:\n  teachers: [h1:7070]\n"), 0o644)
	if _, err := LoadConfig(p, nil); err == nil || !strings.Contains(err.Error(), "needs data.dataset") {
		t.Errorf("teachers without a dataset: %v", err)
	}
}

// TestOnlineInfoChecks: before step 1 every replica's Info is checked
// against the student, and a mismatch is an error naming it: vocab,
// tokenizer, k beyond k_max, two replicas serving different models, and
// a replica that never answers (past teacher_timeout). Nothing is
// trained.
func TestOnlineInfoChecks(t *testing.T) {
	fastRetry(t)
	f := newOnlineFixture(t, 20)
	good := startTeacherd(t, f.teacher, f.tokDir, "", "")
	// A teacher with another vocabulary, one with another tokenizer, one
	// with other weights.
	bigVocab := t.TempDir()
	cfg, _ := model.Preset(model.ArchQwen3)
	cfg.VocabSize, cfg.Hidden, cfg.Layers, cfg.Intermediate, cfg.MaxPositions, cfg.Heads, cfg.KVHeads, cfg.HeadDim = 300, 32, 1, 64, 256, 4, 2, 8
	model.WriteCheckpoint(bigVocab, cfg, model.Init(cfg, model.InitOptions{Seed: 5}), "BF16")
	wrongVocab := startTeacherd(t, bigVocab, f.tokDir, "", "")
	otherTok := filepath.Join(t.TempDir(), "tok2")
	os.MkdirAll(otherTok, 0o755)
	b, _ := os.ReadFile(filepath.Join(f.tokDir, "tokenizer.json"))
	os.WriteFile(filepath.Join(otherTok, "tokenizer.json"), bytes.Replace(bytes.Replace(b, []byte(`"a b"`), []byte(`"b a"`), 1), []byte(`"ab"`), []byte(`"ba"`), 1), 0o644)
	wrongTok := startTeacherd(t, f.teacher, otherTok, "", "")
	otherModel := startTeacherd(t, teacherModel(t, 64, 1), f.tokDir, "", "")
	for _, c := range []struct {
		addrs []string
		over  []string
		want  []string
	}{
		{[]string{wrongVocab.addr()}, nil, []string{"teacher t0 at " + wrongVocab.addr(), "vocab_size 300, but the student has 260"}},
		{[]string{wrongTok.addr()}, nil, []string{"teacher t0 at " + wrongTok.addr(), "tokenizer", "must share a tokenizer"}},
		{[]string{good.addr()}, []string{"distill.k=32"}, []string{"distill.k 32 exceeds the daemon's k_max 16"}},
		{[]string{good.addr(), otherModel.addr()}, nil, []string{"teacher fingerprint", "must serve the same model"}},
		{[]string{good.addr(), "127.0.0.1:1"}, []string{"distill.teacher_timeout=20ms"}, []string{"127.0.0.1:1", "did not answer Info within distill.teacher_timeout 20ms"}},
	} {
		cfg := onlineConfig(t, f.tokDir, f.file, filepath.Join(t.TempDir(), "run"), "", c.addrs, c.over...)
		var log bytes.Buffer
		res, err := Run(cfg, Options{Log: &log})
		if err == nil {
			t.Errorf("%v %v: no error", c.addrs, c.over)
			continue
		}
		for _, w := range c.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("%v %v: error %q lacks %q", c.addrs, c.over, err, w)
			}
		}
		// There is no cache here: ErrMismatch said "cache does not
		// match the student".
		if strings.Contains(err.Error(), "cache") {
			t.Errorf("%v %v: error %q speaks of a cache", c.addrs, c.over, err)
		}
		if res != nil && len(res.Steps) > 0 {
			t.Errorf("%v: trained %d steps before the check failed", c.addrs, len(res.Steps))
		}
	}
}

// TestOnlineDocs: examples/online.yaml loads as one teacher of two
// replicas with a write cache.
func TestOnlineDocs(t *testing.T) {
	c, err := LoadConfig("../../examples/online.yaml", nil)
	if err != nil {
		t.Fatal(err)
	}
	o := c.Distill.OnlineConfig
	if len(o.Teachers) != 1 || len(o.Teachers[0].Addrs) != 2 || o.Teachers[0].Name != "qwen3-8b" || o.WriteCache == "" || o.K != 64 || c.Distill.KDWeight != 1 {
		t.Fatalf("examples/online.yaml read as %+v", c.Distill)
	}
}

// TestOnlineMultiConfig: several distill.teachers entries are several
// teachers, each with its name (default t<index>) and weight (default
// 1); names must be unique and usable as metric keys and directory names
// (their write caches), weights positive, and no address in two entries.
// Errors name the entry.
func TestOnlineMultiConfig(t *testing.T) {
	p := filepath.Join(t.TempDir(), "c.yaml")
	os.WriteFile(p, []byte("run_dir: x\nmodel:\n  init_from: y\ndata:\n  seq_len: 64\n  dataset:\n    files: [a.jsonl]\ndistill:\n  teachers:\n    - {addrs: [h1:7070, h2:7070], name: big, weight: 0.75}\n    - {addrs: [h3:7070]}\n"), 0o644)
	c, err := LoadConfig(p, nil)
	if err != nil {
		t.Fatal(err)
	}
	ts := c.Distill.Teachers
	if len(ts) != 2 || ts[0].Name != "big" || ts[0].Weight != 0.75 || len(ts[0].Addrs) != 2 || ts[1].Name != "t1" || ts[1].Weight != 1 || ts[1].Addrs[0] != "h3:7070" {
		t.Fatalf("two teachers read as %+v", ts)
	}
	for over, want := range map[string][]string{
		"distill.teachers=[{addrs: [a:1], name: x}, {addrs: [b:1], name: x}]": {"distill.teachers[1].name", `"x" is also the name of distill.teachers[0]`},
		"distill.teachers=[{addrs: [a:1]}, {addrs: [b:1], name: t0}]":         {"distill.teachers[1].name", `"t0" is also the name of distill.teachers[0]`},
		"distill.teachers=[{addrs: [a:1], name: a/b}, {addrs: [b:1]}]":        {"distill.teachers[0].name", `"a/b"`, "letters, digits"},
		"distill.teachers=[{addrs: [a:1], name: ..}, {addrs: [b:1]}]":         {"distill.teachers[0].name", `".."`},
		"distill.teachers=[{addrs: [a:1]}, {addrs: [b:1], weight: -1}]":       {"distill.teachers[1].weight", "-1", "positive"},
		"distill.teachers=[{addrs: [a:1]}, {addrs: [], name: b}]":             {"distill.teachers[1].addrs", "empty"},
		// One daemon in two entries trained as one teacher at the sum of
		// its weights.
		"distill.teachers=[{addrs: [a:1, h:7070], name: x}, {addrs: [b:1]}, {addrs: [H:7070], weight: 0.5}]": {
			"distill.teachers[2].addrs[0]: H:7070 is also distill.teachers[0].addrs[1] (x): the same daemon in two entries", "give it once (with weight: 1.5, the sum of both entries' weights, it trains as now)"},
	} {
		_, err := LoadConfig(p, []string{over})
		if !errors.Is(err, ErrConfig) {
			t.Errorf("%s: want ErrConfig, got %v", over, err)
			continue
		}
		for _, w := range want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("%s: error %q lacks %q", over, err, w)
			}
		}
	}
}

// askedFrom watches which samples the teachers answer from now on; the
// function it returns fails t if any lies in one of the chunks (a write
// cache's: those must be read from it, not asked again) and stops
// watching. The hook is called from the replicas' goroutines.
func askedFrom(t *testing.T, chunks []cache.ReaderChunk) func(*testing.T) {
	var mu sync.Mutex
	var bad []int64
	testHookAnswered = func(i int64) {
		for _, ch := range chunks {
			if i >= ch.Start && i < ch.End {
				mu.Lock()
				bad = append(bad, i)
				mu.Unlock()
			}
		}
	}
	t.Cleanup(func() { testHookAnswered = nil })
	return func(t *testing.T) {
		t.Helper()
		testHookAnswered = nil
		mu.Lock()
		defer mu.Unlock()
		if len(bad) > 0 {
			t.Errorf("the teachers were asked samples %v, which the write cache holds (chunks %v)", bad, chunks)
		}
	}
}
