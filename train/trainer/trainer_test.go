package trainer

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"distill/cache"
	"distill/cache/cachetest"
	"distill/train"
	"distill/train/tbevent"
	"distill/train/testcache"
)

var (
	buildOnce sync.Once
	built     *testcache.Built
	buildErr  error
)

// testCache is a real cache (a tiny teacher's top-k over random tokens),
// built once per test binary: 96 samples of 6..40 tokens, V = 97, k = 8.
func testCache(t *testing.T) *testcache.Built {
	buildOnce.Do(func() {
		dir, err := os.MkdirTemp("", "trainer-cache-")
		if err != nil {
			buildErr = err
			return
		}
		built, buildErr = testcache.Build(testcache.Options{Dir: dir, Vocab: 97, K: 8, Samples: 96, Chunk: 16, MinLen: 6, MaxLen: 40, Seed: 5})
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return built
}

func TestMain(m *testing.M) {
	if os.Getenv("TRAINER_CHILD_CONFIG") != "" {
		child()
		return
	}
	code := m.Run()
	if built != nil {
		os.RemoveAll(filepath.Dir(built.CacheDir))
	}
	os.Exit(code)
}

// child runs a training process for the SIGKILL tests. With
// TRAINER_CHILD_HOLD=STEP:FILE it creates FILE when step STEP begins its
// first row; with TRAINER_CHILD_HOLD_SAVE=STEP:FILE, when the checkpoint
// of step STEP is written but not yet renamed into place. Then it waits
// there for good, so that the parent kills it at a known point, whatever
// the speed of the machine. It waits by reading stdin, which the parent
// keeps open (startChild) and never writes: the read blocks in the kernel,
// so the runtime cannot take the held process for deadlocked, and it ends
// if the parent dies.
func child() {
	hold := func(env string) (int, func()) {
		v := os.Getenv(env)
		if v == "" {
			return -1, nil
		}
		n, file, _ := strings.Cut(v, ":")
		at, err := strconv.Atoi(n)
		if err != nil {
			fmt.Fprintf(os.Stderr, "%s=%q: want STEP:FILE\n", env, v)
			os.Exit(2)
		}
		return at, func() {
			if err := os.WriteFile(file, nil, 0o644); err != nil {
				fmt.Fprintln(os.Stderr, "hold:", err)
				os.Exit(2)
			}
			io.Copy(io.Discard, os.Stdin)
			fmt.Fprintln(os.Stderr, "hold: stdin closed: the test is gone")
			os.Exit(3)
		}
	}
	if at, wait := hold("TRAINER_CHILD_HOLD"); wait != nil {
		testHookRow = func(step, row int) {
			if step == at && row == 0 {
				wait()
			}
		}
	}
	if at, wait := hold("TRAINER_CHILD_HOLD_SAVE"); wait != nil {
		testHookPublish = func(step int) {
			if step == at {
				wait()
			}
		}
	}
	cfg, err := LoadConfig(os.Getenv("TRAINER_CHILD_CONFIG"), nil)
	if err == nil {
		var o Options
		if o, err = childRank(); err == nil {
			var res *Result
			if res, err = Run(cfg, o); err == nil {
				err = writeChildResult(res)
			}
		}
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	os.Exit(0)
}

func tinyConfig(t *testing.T, b *testcache.Built, runDir string, over ...string) *Config {
	y := fmt.Sprintf(`run_dir: %s
seed: 3
model:
  random: {arch: qwen3, vocab_size: 97, hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 4,
           num_key_value_heads: 2, head_dim: 8, intermediate_size: 64, max_position_embeddings: 256, init_seed: 1}
  tokenizer_fingerprint: testcache-tokenizer
data:
  cache: [%s]
  seq_len: 64
  global_batch_tokens: 150
  eval_range: [0, 16]
distill: {kd_loss: fwd_kl, tail: bucket, kd_weight: 1, sft_weight: 0.1}
optim: {lr: 3e-3, min_lr: 3e-4, lr_schedule: cosine, warmup_steps: 2, max_grad_norm: 1}
train: {max_steps: 12, threads: 2}
eval: {every: 6}
checkpoint: {every: 4, keep: 2}
log: {every: 4, progress: "off"}
`, runDir, b.CacheDir)
	p := filepath.Join(t.TempDir(), "cfg.yaml")
	if err := os.WriteFile(p, []byte(y), 0o644); err != nil {
		t.Fatal(err)
	}
	cfg, err := LoadConfig(p, over)
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

func losses(r *Result) []float64 {
	var out []float64
	for _, s := range r.Steps {
		out = append(out, s.Loss)
	}
	return out
}

// TestTrainResume: 12 steps straight, versus 6 steps abandoned after the
// checkpoint at step 4 (steps 5 and 6 are lost) and a resume: the resumed
// steps 5..12 give bit-identical losses, grad norms and final weights.
// Also checks that training lowers the eval loss, that every step used the
// global batch, and what the run directory holds.
func TestTrainResume(t *testing.T) {
	b := testCache(t)
	full, err := Run(tinyConfig(t, b, filepath.Join(t.TempDir(), "full")), Options{Log: io.Discard})
	if err != nil {
		t.Fatal(err)
	}
	if len(full.Steps) != 12 || len(full.Evals) != 2 {
		t.Fatalf("steps %d evals %d", len(full.Steps), len(full.Evals))
	}
	for _, s := range full.Steps {
		if s.Tokens < 150 || s.LossTokens == 0 || s.LossTokens >= s.Tokens || !(s.GradNorm > 0) || s.PeakMemBytes <= 0 || !(s.GFLOPs > 0) {
			t.Fatalf("step %+v", s)
		}
	}
	if ls := losses(full); !(ls[11] < ls[0]) {
		t.Fatalf("training loss did not fall: %v", ls)
	}

	runDir := filepath.Join(t.TempDir(), "resumed")
	part, err := Run(tinyConfig(t, b, runDir), Options{Log: io.Discard, StopAfter: 6})
	if err != nil {
		t.Fatal(err)
	}
	if len(part.Steps) != 6 || !strings.HasSuffix(part.Checkpoint, "step-00000004") {
		t.Fatalf("partial run: %d steps, checkpoint %q", len(part.Steps), part.Checkpoint)
	}
	// A checkpoint a crash left half-written (a newer step, a truncated
	// file) is neither resumed from nor kept.
	torn := filepath.Join(runDir, "checkpoints", ".tmp-step-00000006-999")
	os.MkdirAll(torn, 0o755)
	os.WriteFile(filepath.Join(torn, "model.safetensors"), []byte("\x08\x00"), 0o644)
	var log strings.Builder
	rest, err := Run(tinyConfig(t, b, runDir), Options{Log: &log})
	if err != nil {
		t.Fatal(err)
	}
	if l := log.String(); !strings.Contains(l, "resumed from") || !strings.Contains(l, "step 8/12 loss") || !strings.Contains(l, "eval step 12:") || strings.Contains(l, "\r") {
		t.Fatalf("log of the resumed run (progress off: plain lines every 4 steps):\n%s", l)
	}
	if !strings.HasSuffix(rest.Resumed, "step-00000004") || len(rest.Steps) != 8 {
		t.Fatalf("resumed from %q, ran %d steps\n%s", rest.Resumed, len(rest.Steps), log.String())
	}
	for i, s := range rest.Steps {
		w := full.Steps[4+i]
		if s.Step != w.Step || s.Loss != w.Loss || s.GradNorm != w.GradNorm || s.KD != w.KD || s.LR != w.LR || s.Tokens != w.Tokens {
			t.Fatalf("step %d after resume: loss %.17g |g| %.17g, uninterrupted %.17g %.17g", s.Step, s.Loss, s.GradNorm, w.Loss, w.GradNorm)
		}
	}
	for i, e := range rest.Evals {
		if !reflect.DeepEqual(e, full.Evals[i]) {
			t.Fatalf("eval %d: %+v vs %+v", i, e, full.Evals[i])
		}
	}
	a, _ := os.ReadFile(filepath.Join(full.Checkpoint, "model.safetensors"))
	c, _ := os.ReadFile(filepath.Join(rest.Checkpoint, "model.safetensors"))
	if len(a) == 0 || string(a) != string(c) {
		t.Fatal("final weights differ between the straight and the resumed run")
	}
	// metrics.jsonl holds each step once, in order, despite the lost steps
	// 5 and 6 of the first process; keep: 2 left two checkpoints.
	steps := metricSteps(t, runDir)
	if len(steps) != 12 || steps[0] != 1 || steps[11] != 12 {
		t.Fatalf("metrics.jsonl steps %v", steps)
	}
	if _, err := os.Stat(torn); !os.IsNotExist(err) {
		t.Fatalf("stale %s not removed: %v", torn, err)
	}
	ents, _ := os.ReadDir(filepath.Join(runDir, "checkpoints"))
	if len(ents) != 2 || ents[0].Name() != "step-00000008" || ents[1].Name() != "step-00000012" {
		t.Fatalf("checkpoints %v", ents)
	}
	if _, err := LoadConfig(filepath.Join(runDir, "config.yaml"), nil); err != nil {
		t.Fatalf("resolved config does not load back: %v", err)
	}
	tbs, _ := filepath.Glob(filepath.Join(runDir, "tb", "events.out.tfevents.*"))
	if len(tbs) != 2 {
		t.Fatalf("event files %v", tbs)
	}
	evs, err := tbevent.Read(tbs[0])
	if err != nil || len(evs) < 6 || evs[1].Scalars["train/loss"] != float32(full.Steps[0].Loss) {
		t.Fatalf("tensorboard: %v %+v", err, evs)
	}
	// The resumed run's file starts (after file_version) with a SessionLog
	// START at step 5. Replaying both files as TensorBoard does (in file
	// order; a START drops earlier events at steps >= its step) leaves
	// each training step once, with the resumed run's values.
	evs2, err := tbevent.Read(tbs[1])
	if err != nil || len(evs2) < 2 || !evs2[1].SessionStart || evs2[1].Step != 5 {
		t.Fatalf("resumed event file should start with SessionLog START at step 5: %v %+v", err, evs2[:min(2, len(evs2))])
	}
	var seen []tbevent.Event
	for _, ev := range append(evs, evs2...) {
		if ev.SessionStart {
			kept := seen[:0]
			for _, e := range seen {
				if e.Step < ev.Step {
					kept = append(kept, e)
				}
			}
			seen = kept
		}
		seen = append(seen, ev)
	}
	var lossSteps []int64
	for _, e := range seen {
		if v, ok := e.Scalars["train/loss"]; ok {
			lossSteps = append(lossSteps, e.Step)
			if v != float32(full.Steps[e.Step-1].Loss) {
				t.Fatalf("tensorboard step %d loss %v, uninterrupted run %v", e.Step, v, full.Steps[e.Step-1].Loss)
			}
		}
	}
	if len(lossSteps) != 12 || lossSteps[0] != 1 || lossSteps[11] != 12 {
		t.Fatalf("tensorboard train/loss steps after purge: %v, want 1..12 once", lossSteps)
	}
	// Training moves the student toward the teacher on held-out samples.
	if !(full.Evals[1].KD < full.Evals[0].KD) {
		t.Fatalf("eval kd %g -> %g", full.Evals[0].KD, full.Evals[1].KD)
	}
	// Nothing left to do: a rerun is a no-op.
	again, err := Run(tinyConfig(t, b, runDir), Options{Log: io.Discard})
	if err != nil || len(again.Steps) != 0 {
		t.Fatalf("rerun: %v, %d steps", err, len(again.Steps))
	}
}

func metricSteps(t *testing.T, runDir string) []int {
	f, err := os.Open(filepath.Join(runDir, "metrics.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var steps []int
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		var l struct {
			Type string `json:"type"`
			Step int    `json:"step"`
		}
		if err := json.Unmarshal(sc.Bytes(), &l); err != nil {
			t.Fatalf("metrics line %q: %v", sc.Text(), err)
		}
		if l.Type == "train" {
			steps = append(steps, l.Step)
		}
	}
	return steps
}

// killHeldChild runs the training child on cfgPath held at step by env
// (TRAINER_CHILD_HOLD or TRAINER_CHILD_HOLD_SAVE, see child), SIGKILLs it
// once it holds, and checks that the kill is what ended it.
func killHeldChild(t *testing.T, cfgPath, env string, step int) {
	t.Helper()
	held := filepath.Join(t.TempDir(), "held")
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "TRAINER_CHILD_CONFIG="+cfgPath, fmt.Sprintf("%s=%d:%s", env, step, held))
	var stderr strings.Builder
	cmd.Stderr = &stderr
	// The child holds by reading stdin: the pipe stays open, unwritten,
	// until Wait has seen the child exit.
	if _, err := cmd.StdinPipe(); err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { cmd.Wait(); close(exited) }()
	// Until the child holds or exits; no deadline decides anything (go
	// test's -timeout catches a hang).
	for {
		if _, err := os.Stat(held); err == nil {
			break
		}
		select {
		case <-exited:
			t.Fatalf("the child exited before holding (%s=%d): %v\n%s", env, step, cmd.ProcessState, stderr.String())
		case <-time.After(5 * time.Millisecond):
		}
	}
	cmd.Process.Signal(syscall.SIGKILL)
	<-exited
	if ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); !ok || !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
		t.Fatalf("the held child was not ended by SIGKILL: %v\n%s", cmd.ProcessState, stderr.String())
	}
}

// TestResumeAfterSIGKILL: a child process trains and is SIGKILLed at a
// known point: inside step 5, after its checkpoint of step 4; and in the
// save of step 6, its files written and synced but not renamed into
// place. A resumed run starts from step 4's checkpoint, drops the half
// save, and reproduces the uninterrupted loss curve exactly.
func TestResumeAfterSIGKILL(t *testing.T) {
	b := testCache(t)
	full, err := Run(tinyConfig(t, b, filepath.Join(t.TempDir(), "full"), "checkpoint.every=2"), Options{Log: io.Discard})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name, env string
		step      int
	}{
		{"mid-step", "TRAINER_CHILD_HOLD", 5},
		{"mid-save", "TRAINER_CHILD_HOLD_SAVE", 6},
	} {
		t.Run(c.name, func(t *testing.T) {
			runDir := filepath.Join(t.TempDir(), "killed")
			cfg := tinyConfig(t, b, runDir, "checkpoint.every=2")
			cfgPath := filepath.Join(t.TempDir(), "child.yaml")
			writeResolvedTo(t, cfg, cfgPath)
			killHeldChild(t, cfgPath, c.env, c.step)
			ck, _ := LatestCheckpoint(runDir)
			if ck != checkpointDir(runDir, 4) {
				t.Fatalf("killed %s at step %d: latest checkpoint %q, want step 4's", c.name, c.step, ck)
			}
			half, _ := filepath.Glob(filepath.Join(runDir, "checkpoints", ".tmp-*"))
			if c.name == "mid-save" && len(half) != 1 {
				t.Fatalf("killed mid-save: %d half-written checkpoints %v, want 1", len(half), half)
			}
			rest, err := Run(tinyConfig(t, b, runDir, "checkpoint.every=2"), Options{Log: io.Discard})
			if err != nil {
				t.Fatal(err)
			}
			if rest.Resumed != ck || len(rest.Steps) != 8 {
				t.Fatalf("resumed from %q (latest %q), %d steps, want 8", rest.Resumed, ck, len(rest.Steps))
			}
			for _, s := range rest.Steps {
				w := full.Steps[s.Step-1]
				if s.Loss != w.Loss || s.GradNorm != w.GradNorm {
					t.Fatalf("step %d after SIGKILL+resume: loss %.17g, uninterrupted %.17g", s.Step, s.Loss, w.Loss)
				}
			}
			if steps := metricSteps(t, runDir); len(steps) != 12 {
				t.Fatalf("metrics steps %v", steps)
			}
			if left, _ := filepath.Glob(filepath.Join(runDir, "checkpoints", ".tmp-*")); len(left) != 0 {
				t.Fatalf("the resumed run left the half save: %v", left)
			}
		})
	}
}

func writeResolvedTo(t *testing.T, cfg *Config, path string) {
	c := *cfg
	dir := t.TempDir()
	c.RunDir = dir
	if err := writeResolved(&c); err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile(filepath.Join(dir, "config.yaml"))
	b = []byte(strings.Replace(string(b), "run_dir: "+dir, "run_dir: "+cfg.RunDir, 1))
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestMismatch: a cache of another tokenizer or vocabulary is refused,
// naming both sides.
func TestMismatch(t *testing.T) {
	b := testCache(t)
	_, err := Run(tinyConfig(t, b, t.TempDir(), "model.tokenizer_fingerprint=abc123"), Options{Log: io.Discard})
	if !errors.Is(err, ErrMismatch) || !strings.Contains(err.Error(), "abc123") || !strings.Contains(err.Error(), "testcache-tokenizer") {
		t.Fatalf("tokenizer mismatch: %v", err)
	}
	_, err = Run(tinyConfig(t, b, t.TempDir(), "model.random.vocab_size=128"), Options{Log: io.Discard})
	if !errors.Is(err, ErrMismatch) || !strings.Contains(err.Error(), "vocab_size 97") || !strings.Contains(err.Error(), "128") {
		t.Fatalf("vocab mismatch: %v", err)
	}
	// Resuming on another cache (same tokenizer and vocabulary) is refused.
	other, err := testcache.Build(testcache.Options{Dir: t.TempDir(), Vocab: 97, K: 8, Samples: 32, Chunk: 16, MinLen: 6, MaxLen: 40, Seed: 6})
	if err != nil {
		t.Fatal(err)
	}
	runDir := t.TempDir()
	if _, err := Run(tinyConfig(t, b, runDir, "train.max_steps=3"), Options{Log: io.Discard}); err != nil {
		t.Fatal(err)
	}
	_, err = Run(tinyConfig(t, b, runDir, "train.max_steps=4", "data.cache=["+other.CacheDir+"]"), Options{Log: io.Discard})
	if !errors.Is(err, ErrResume) || !strings.Contains(err.Error(), "dataset") {
		t.Fatalf("resume on another cache: %v", err)
	}
	_, err = Run(tinyConfig(t, b, t.TempDir(), "data.seq_len=20"), Options{Log: io.Discard})
	if !errors.Is(err, ErrData) || !strings.Contains(err.Error(), "data.truncate") {
		t.Fatalf("long sample: %v", err)
	}
	// Resuming with other batching is refused, naming the key and both
	// values; a changed schedule resumes with a warning.
	for _, c := range []struct{ set, want string }{
		{"data.global_batch_tokens=999", "data.global_batch_tokens = "},
		{"data.shuffle_window=7", "data.shuffle_window = "},
		{"data.eval_range=[0,5]", "data.eval_range = "},
	} {
		_, err = Run(tinyConfig(t, b, runDir, "train.max_steps=4", c.set), Options{Log: io.Discard})
		if !errors.Is(err, ErrResume) || !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), "the config says") {
			t.Fatalf("resume with %s: %v", c.set, err)
		}
	}
	var log strings.Builder
	if _, err := Run(tinyConfig(t, b, runDir, "train.max_steps=4"), Options{Log: &log}); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(log.String(), "the schedule changed") || !strings.Contains(log.String(), "over 3 steps -> ") {
		t.Fatalf("resume with a longer schedule should warn: %s", log.String())
	}
}

// TestConfigErrors: unknown keys name the line, bad values name the key,
// overrides reach nested keys.
func TestConfigErrors(t *testing.T) {
	p := filepath.Join(t.TempDir(), "c.yaml")
	os.WriteFile(p, []byte("run_dir: x\nmodel:\n  init_from: y\ndata:\n  cache: [z]\n  seq_lenn: 5\n"), 0o644)
	if _, err := LoadConfig(p, nil); !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "line 6") || !strings.Contains(err.Error(), "seq_lenn") {
		t.Fatalf("unknown key: %v", err)
	}
	os.WriteFile(p, []byte("run_dir: x\nmodel:\n  init_from: y\ndata:\n  cache: [z]\n"), 0o644)
	for over, want := range map[string]string{
		"optim.lr_schedule=cosinus": "lr_schedule",
		"distill.kd_loss=kl":        "kd_loss",
		"quant=int4":                "quant",
		"data.eval_range=[5,2]":     "data.eval_range",
		"optim.beta1=1":             "optim.beta1: 1: want",
		"lr":                        "key.path=value",
		"train.device=tpu":          `--set train.device=tpu: train.device: "tpu": want auto, cpu or cuda`,
	} {
		if _, err := LoadConfig(p, []string{over}); !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: %v", over, err)
		}
	}
	c, err := LoadConfig(p, []string{"optim.lr=0.5", "train.max_steps=7", "data.eval_range=[0, 3]", "train.device=cpu"})
	if err != nil || c.Optim.LR != 0.5 || c.Train.MaxSteps != 7 || c.Data.EvalRange[1] != 3 || c.Optim.Beta2 != 0.95 || c.Train.Device != "cpu" {
		t.Fatalf("overrides: %v %+v", err, c)
	}
}

// TestDeviceErrorNamesTheKey: train.device cuda on a machine without the
// CUDA driver names train.device, what it was set to and how to set the
// CPU there; it said "train.device: device: unavailable: --device cuda:
// ... without a GPU use --device cpu", a flag the user never gave. The
// sentence is the whole message, ErrConfig in its chain only: it began
// "trainer: bad config: ".
func TestDeviceErrorNamesTheKey(t *testing.T) {
	t.Setenv("DISTILL_LIBCUDA", filepath.Join(t.TempDir(), "libcuda.so.1"))
	cfg := Defaults()
	cfg.Train.Device = "cuda"
	_, err := backend(&cfg, io.Discard, 0)
	if !errors.Is(err, ErrConfig) || !strings.HasPrefix(err.Error(), "train.device cuda: cannot load the CUDA driver") ||
		!strings.HasSuffix(err.Error(), "; without a GPU, set train.device: cpu") || strings.Contains(err.Error(), "--device") || strings.Count(err.Error(), "train.device") != 2 {
		t.Errorf("train.device cuda without a driver: %v", err)
	}
}

// TestEvalPackingInvariant: eval metrics are means over loss positions, so
// the row length does not change them; the position count matches the
// samples as written, and token accuracy / top-1 agreement / the expected
// calibration error match a direct count from each sample's full
// log-probs run alone (Student.LogProbs, no packing, no tiling).
func TestEvalPackingInvariant(t *testing.T) {
	b := testCache(t)
	cfg := tinyConfig(t, b, t.TempDir())
	s, err := openStudent(cfg, io.Discard, 0)
	if err != nil {
		t.Fatal(err)
	}
	rd, err := cache.OpenReader(b.CacheDir)
	if err != nil {
		t.Fatal(err)
	}
	lo := cfg.LossOptions(1)
	r := cache.Range{Start: 0, End: 24}
	// Row length must not change the metrics (means over positions), up
	// to float32 summation order.
	a, err := Evaluate(s, rd, r, 40, false, &lo)
	if err != nil {
		t.Fatal(err)
	}
	c, err := Evaluate(s, rd, r, 256, false, &lo)
	if err != nil {
		t.Fatal(err)
	}
	if a.Tokens != c.Tokens || a.Samples != 24 || math.Abs(a.KD-c.KD) > 1e-5*a.KD || a.TokenAccuracy != c.TokenAccuracy || a.Top1Agreement != c.Top1Agreement {
		t.Fatalf("seq_len 40: %+v\nseq_len 256: %+v", a, c)
	}
	// Direct count of the loss positions from the samples as written.
	n := 0
	for _, smp := range b.Samples[:24] {
		for t := 1; t < len(smp.Tokens); t++ {
			n += int(smp.Mask[t])
		}
	}
	if a.Tokens != n {
		t.Fatalf("eval counted %d positions, the samples have %d", a.Tokens, n)
	}
	acc, agree := 0, 0
	// The calibration bins, counted here from the full log-probs.
	var binN, binAcc [15]float64
	var binConf [15]float64
	for _, smp := range b.Samples[:24] {
		T := len(smp.Tokens)
		lp, err := s.LogProbs(&train.Batch{Tokens: smp.Tokens, Starts: []int32{0, int32(T)}, Mask: smp.Mask})
		if err != nil {
			t.Fatal(err)
		}
		for t := 0; t+1 < T; t++ {
			if smp.Mask[t+1] == 0 {
				continue
			}
			row := lp[t*97 : (t+1)*97]
			best := 0
			for v := range row {
				if row[v] > row[best] {
					best = v
				}
			}
			if int32(best) == smp.Tokens[t+1] {
				acc++
			}
			if int32(best) == smp.TopKIDs[t*b.Manifest.K] {
				agree++
			}
			p := math.Exp(float64(row[best]))
			k := int(math.Min(math.Floor(p*15), 14))
			binN[k]++
			binConf[k] += p
			if int32(best) == smp.Tokens[t+1] {
				binAcc[k]++
			}
		}
	}
	if a.TokenAccuracy != float64(acc)/float64(n) || a.Top1Agreement != float64(agree)/float64(n) {
		t.Fatalf("accuracy %g agreement %g, direct count %d/%d %d/%d", a.TokenAccuracy, a.Top1Agreement, acc, n, agree, n)
	}
	ece := 0.0
	for k := range binN {
		if binN[k] > 0 {
			ece += binN[k] / float64(n) * math.Abs(binAcc[k]/binN[k]-binConf[k]/binN[k])
		}
	}
	if math.Abs(a.ECE-ece) > 1e-5 || ece == 0 {
		t.Fatalf("ECE %g, from the full log-probs %g", a.ECE, ece)
	}
	if agree == 0 {
		t.Fatal("a random student never agrees with the teacher's top-1: the check is vacuous")
	}
}

// TestQADRun: quant: nvfp4 calibrates, freezes the amax, trains, saves the
// amax in the checkpoint, and resumes bit-identically; its losses differ
// from the unquantized run's (the fake quantization is really on).
func TestQADRun(t *testing.T) {
	b := testCache(t)
	over := []string{"quant=nvfp4", "calib_batches=2", "train.max_steps=8", "eval.every=0", "model.random.hidden_size=32", "model.random.intermediate_size=64"}
	full, err := Run(tinyConfig(t, b, filepath.Join(t.TempDir(), "full"), over...), Options{Log: io.Discard})
	if err != nil {
		t.Fatal(err)
	}
	plain, err := Run(tinyConfig(t, b, filepath.Join(t.TempDir(), "plain"), "train.max_steps=8", "eval.every=0"), Options{Log: io.Discard})
	if err != nil {
		t.Fatal(err)
	}
	if full.Steps[0].Loss == plain.Steps[0].Loss || full.Steps[0].Tokens != plain.Steps[0].Tokens {
		t.Fatalf("QAD step 1 %+v vs plain %+v: same loss (quantization off?) or different data", full.Steps[0], plain.Steps[0])
	}
	runDir := filepath.Join(t.TempDir(), "qad")
	if _, err := Run(tinyConfig(t, b, runDir, over...), Options{Log: io.Discard, StopAfter: 5}); err != nil {
		t.Fatal(err)
	}
	var st State
	sb, _ := os.ReadFile(filepath.Join(checkpointDir(runDir, 4), "state.json"))
	if err := json.Unmarshal(sb, &st); err != nil || len(st.QuantAmax) != 2*11 {
		t.Fatalf("state.json: %v, %d amax values", err, len(st.QuantAmax))
	}
	rest, err := Run(tinyConfig(t, b, runDir, over...), Options{Log: io.Discard})
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range rest.Steps {
		if w := full.Steps[s.Step-1]; s.Loss != w.Loss || s.GradNorm != w.GradNorm {
			t.Fatalf("QAD step %d after resume: loss %.17g, uninterrupted %.17g", s.Step, s.Loss, w.Loss)
		}
	}
	if _, err := Run(tinyConfig(t, b, runDir, "train.max_steps=9", "eval.every=0"), Options{Log: io.Discard}); !errors.Is(err, ErrResume) {
		t.Fatalf("resuming a QAD run without quant: %v", err)
	}
}

// TestTrainExampleDocumentsEveryKey: examples/train.yaml loads, and every
// key of Config appears in it (it is the reference of the config keys).
func TestTrainExampleDocumentsEveryKey(t *testing.T) {
	p := "../../examples/train.yaml"
	if _, err := LoadConfig(p, nil); err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile(p)
	var walk func(rt reflect.Type, prefix string)
	walk = func(rt reflect.Type, prefix string) {
		for rt.Kind() == reflect.Pointer {
			rt = rt.Elem()
		}
		for i := 0; i < rt.NumField(); i++ {
			f := rt.Field(i)
			tag := strings.Split(f.Tag.Get("yaml"), ",")[0]
			if !strings.Contains(string(b), tag+":") {
				t.Errorf("key %s%s is not in %s", prefix, tag, p)
			}
			ft := f.Type
			for ft.Kind() == reflect.Pointer {
				ft = ft.Elem()
			}
			if ft.Kind() == reflect.Struct {
				walk(ft, prefix+tag+".")
			}
		}
	}
	walk(reflect.TypeOf(Config{}), "")
}

// TestPacking: a step's rows hold the samples of the seeded order (minus
// the held-out range) back to back, never split, each row within seq_len,
// with Starts at the sample boundaries, and at least the token budget.
func TestPacking(t *testing.T) {
	b := testCache(t)
	rd, err := cache.OpenReader(b.CacheDir)
	if err != nil {
		t.Fatal(err)
	}
	held := cache.Range{Start: 0, End: 16}
	st, err := newStream(rd, 9, 4, held, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer st.close()
	it, _ := rd.Iter(cache.IterOptions{Seed: 9, Window: 4})
	defer it.Close()
	p := &packer{seqLen: 64, k: 8}
	for step := 0; step < 5; step++ {
		rows, err := p.nextStep(st, 150)
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for ri, r := range rows {
			if len(r.Tokens) > 64 || len(r.Tokens) == 0 || int(r.Starts[len(r.Starts)-1]) != len(r.Tokens) {
				t.Fatalf("step %d row %d: %d tokens, starts %v", step, ri, len(r.Tokens), r.Starts)
			}
			if err := r.Check(97); err != nil {
				t.Fatal(err)
			}
			for q := 0; q+1 < len(r.Starts); q++ {
				var want cache.Sample
				for it.Next() {
					if want = it.Sample(); want.Index >= 16 {
						break
					}
				}
				got := r.Tokens[r.Starts[q]:r.Starts[q+1]]
				if len(got) != len(want.Tokens) || got[0] != want.Tokens[0] || got[len(got)-1] != want.Tokens[len(want.Tokens)-1] {
					t.Fatalf("step %d row %d sample %d: not sample %d of the order", step, ri, q, want.Index)
				}
				if r.TopIDs[int(r.Starts[q])*8] != want.TopKIDs[0] {
					t.Fatalf("teacher ids misaligned with tokens")
				}
			}
			n += len(r.Tokens)
			// A row is closed only when the next sample would not fit.
			if ri+1 < len(rows) && len(r.Tokens)+int(rows[ri+1].Starts[1]) <= 64 {
				t.Fatalf("step %d row %d closed with room for the next sample", step, ri)
			}
		}
		if n < 150 || n-int(rows[len(rows)-1].Starts[len(rows[len(rows)-1].Starts)-1]-rows[len(rows)-1].Starts[len(rows[len(rows)-1].Starts)-2]) >= 150 {
			t.Fatalf("step %d: %d tokens for a budget of 150 (the last sample should cross it)", step, n)
		}
	}
}

// TestPackingSkipsEmptySamples: samples with no tokens (records the data
// layer dropped) are skipped by training rows and eval rows alike.
func TestPackingSkipsEmptySamples(t *testing.T) {
	dir := t.TempDir()
	const V, K = 97, 8
	c, err := cache.Create(dir, cache.Manifest{TeacherFingerprint: "t", TokenizerFingerprint: "tok", DatasetFingerprint: "d",
		VocabSize: V, K: K, Temperature: 1, Samples: 12, Encoding: cache.EncodingLossless}, nil)
	if err != nil {
		t.Fatal(err)
	}
	w, err := c.BeginChunk(0, 12)
	if err != nil {
		t.Fatal(err)
	}
	for i := int64(0); i < 12; i++ {
		s := cache.Sample{Index: i}
		if i%3 != 1 { // samples 1, 4, 7, 10 are empty
			g := cachetest.New(V, K, "bpe", uint64(i))
			gs := g.Sample(5)
			s = cache.Sample{Index: i, Tokens: gs.Tokens, Mask: gs.Mask, TopKIDs: gs.TopKIDs, TopKLogProbs: gs.TopKLogProbs}
		}
		if err := w.Add(s); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Commit(); err != nil {
		t.Fatal(err)
	}
	c.Close()
	rd, err := cache.OpenReader(dir)
	if err != nil {
		t.Fatal(err)
	}
	p := &packer{seqLen: 64, k: K}
	rows, n, err := p.evalRows(rd, cache.Range{Start: 0, End: 12})
	if err != nil {
		t.Fatal(err)
	}
	checkRows := func(what string, rows []*train.Batch) int {
		segs := 0
		for _, r := range rows {
			for q := 0; q+1 < len(r.Starts); q++ {
				if r.Starts[q+1] <= r.Starts[q] {
					t.Fatalf("%s: empty segment at %d in starts %v", what, q, r.Starts)
				}
				segs++
			}
		}
		return segs
	}
	if segs := checkRows("eval", rows); n != 8 || segs != 8 {
		t.Fatalf("eval rows: %d samples, %d segments; want the 8 non-empty samples", n, segs)
	}
	st, err := newStream(rd, 1, 1, cache.Range{}, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer st.close()
	rows, err = p.nextStep(st, 40)
	if err != nil {
		t.Fatal(err)
	}
	if segs := checkRows("train", rows); segs != 8 {
		t.Fatalf("train rows: %d segments for 40 tokens of 5-token samples, want 8", segs)
	}
}

// TestStreamResumeAtEpochEnd: a checkpoint taken when a step consumed the
// last sample of an epoch stores EpochPos = the epoch's length; resuming
// there must go on into the next epoch, not report that the cache has no
// training samples.
func TestStreamResumeAtEpochEnd(t *testing.T) {
	b := testCache(t)
	rd, err := cache.OpenReader(b.CacheDir)
	if err != nil {
		t.Fatal(err)
	}
	held := cache.Range{Start: 0, End: 16}
	st, err := newStream(rd, 9, 4, held, 0, 96)
	if err != nil {
		t.Fatal(err)
	}
	defer st.close()
	s, err := st.next()
	if err != nil {
		t.Fatalf("resume at the end of epoch 0: %v", err)
	}
	if st.epoch != 1 || s.Index < 16 {
		t.Fatalf("got sample %d of epoch %d, want a training sample of epoch 1", s.Index, st.epoch)
	}
}

// TestStreamAllEmpty: a cache whose training samples are all empty
// records is an error, not an endless loop over epochs.
func TestStreamAllEmpty(t *testing.T) {
	dir := t.TempDir()
	c, err := cache.Create(dir, cache.Manifest{TeacherFingerprint: "t", TokenizerFingerprint: "tok", DatasetFingerprint: "d",
		VocabSize: 97, K: 8, Temperature: 1, Samples: 4, Encoding: cache.EncodingLossless}, nil)
	if err != nil {
		t.Fatal(err)
	}
	w, err := c.BeginChunk(0, 4)
	if err != nil {
		t.Fatal(err)
	}
	for i := int64(0); i < 4; i++ {
		if err := w.Add(cache.Sample{Index: i}); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Commit(); err != nil {
		t.Fatal(err)
	}
	c.Close()
	rd, err := cache.OpenReader(dir)
	if err != nil {
		t.Fatal(err)
	}
	st, err := newStream(rd, 1, 1, cache.Range{Start: -1, End: -1}, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer st.close()
	done := make(chan error, 1)
	go func() {
		_, err := (&packer{seqLen: 64, k: 8}).nextStep(st, 40)
		done <- err
	}()
	select {
	case err := <-done:
		if !errors.Is(err, ErrData) {
			t.Fatalf("got %v, want ErrData", err)
		}
	case <-time.After(2 * time.Minute): // watchdog: a healthy nextStep returns at once
		t.Fatal("nextStep loops forever on a cache of empty samples")
	}
}

// openStudent opens cfg's backend and builds a fresh student on it, as a
// one-process run does.
func openStudent(cfg *Config, log io.Writer, ordinal int) (*train.Student, error) {
	be, err := backend(cfg, log, ordinal)
	if err != nil {
		return nil, err
	}
	return initStudent(cfg, be, nil)
}
