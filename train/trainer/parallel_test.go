package trainer

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"distill/compute"
	"distill/compute/computetest"
	"distill/compute/cuda"
	"distill/model"
	"distill/train"
	"distill/train/testcache"
)

// runRanks runs n ranks of cfg (runDirs[i] for rank i) as goroutines of
// one hostGroup, with stops[i] as rank i's Options.Stop, and returns their
// results and logs.
func runRanks(t *testing.T, n int, cfgs []*Config, stops []chan struct{}) ([]*Result, []string) {
	t.Helper()
	res, out, errs := runRanksErr(n, cfgs, stops)
	for i := range errs {
		if errs[i] != nil {
			t.Fatalf("rank %d: %v\n%s", i, errs[i], out[i])
		}
	}
	return res, out
}

// runRanksErr is runRanks returning each rank's error.
func runRanksErr(n int, cfgs []*Config, stops []chan struct{}) ([]*Result, []string, []error) {
	g := computetest.NewHostGroup(n)
	res, logs, errs := make([]*Result, n), make([]bytes.Buffer, n), make([]error, n)
	var wg sync.WaitGroup
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func(rank int) {
			defer wg.Done()
			o := Options{Log: &logs[rank], Parallel: &Parallel{Rank: rank, WorldSize: n,
				Join: func(be compute.Backend) (compute.Collective, error) { return g.Rank(rank, be), nil }}}
			if stops != nil {
				o.Stop = stops[rank]
			}
			res[rank], errs[rank] = Run(cfgs[rank], o)
		}(i)
	}
	wg.Wait()
	out := make([]string, n)
	for i := range errs {
		out[i] = logs[i].String()
	}
	return res, out, errs
}

// closeLosses fails unless b's step and eval losses are a's within rel.
func closeLosses(t *testing.T, what string, a, b *Result, rel float64) {
	t.Helper()
	if len(a.Steps) != len(b.Steps) || len(a.Evals) != len(b.Evals) {
		t.Fatalf("%s: %d steps and %d evals vs %d and %d", what, len(a.Steps), len(a.Evals), len(b.Steps), len(b.Evals))
	}
	for i := range a.Steps {
		x, y := a.Steps[i], b.Steps[i]
		for _, p := range [][2]float64{{x.Loss, y.Loss}, {x.KD, y.KD}, {x.CE, y.CE}, {x.GradNorm, y.GradNorm}} {
			if math.Abs(p[0]-p[1]) > rel*math.Abs(p[0]) {
				t.Fatalf("%s: step %d: loss %v kd %v ce %v grad_norm %v vs %v %v %v %v", what, x.Step, x.Loss, x.KD, x.CE, x.GradNorm, y.Loss, y.KD, y.CE, y.GradNorm)
			}
		}
		if x.Tokens != y.Tokens || x.LossTokens != y.LossTokens || x.Rows != y.Rows {
			t.Fatalf("%s: step %d: %d tokens, %d loss positions, %d rows vs %d, %d, %d", what, x.Step, x.Tokens, x.LossTokens, x.Rows, y.Tokens, y.LossTokens, y.Rows)
		}
	}
	for i := range a.Evals {
		x, y := a.Evals[i], b.Evals[i]
		if math.Abs(x.Loss-y.Loss) > rel*x.Loss || math.Abs(x.Top1Agreement-y.Top1Agreement) > 0.02 {
			t.Fatalf("%s: eval %d: %+v vs %+v", what, i, x, y)
		}
	}
}

// TestDataParallel: two and three ranks (ZeRO stages 0 to 3, over an
// in-process stand-in for the collective) train as one process does on
// the same data: the same steps, tokens and rows, losses and gradient
// norms within fp32 reordering (every rank sums its rows' gradients, then
// the ranks' sums are summed), the same evals; only rank 0 writes a run
// directory, and every rank reports the same metrics.
func TestDataParallel(t *testing.T) {
	b := testCache(t)
	one, err := Run(tinyConfig(t, b, filepath.Join(t.TempDir(), "one")), Options{Log: &bytes.Buffer{}})
	if err != nil {
		t.Fatal(err)
	}
	if one.Steps[0].Rows < 3 {
		t.Fatalf("the config packs %d rows a step: the ranks would not share steps unevenly", one.Steps[0].Rows)
	}
	for _, c := range []struct {
		n, zero int
		layout  string
	}{{2, 0, ""}, {3, 0, ""}, {2, 1, ""}, {3, 1, ""}, {2, 2, ""}, {3, 2, ""}, {2, 3, ""}, {3, 3, ""}, {3, 1, "gathered"}, {2, 3, "gathered"}} {
		n := c.n
		dir := t.TempDir()
		sharded := c.zero > 0 && c.layout == ""
		cfgs := make([]*Config, n)
		for i := range cfgs {
			// Ranks other than 0 get run directories of their own when
			// rank 0 writes the checkpoints alone, to show that they write
			// nothing; sharded, every rank writes its shard into the one
			// run directory (a real job shares one).
			run := filepath.Join(dir, "rank", string(rune('0'+i)))
			if sharded {
				run = filepath.Join(dir, "run")
			}
			cfgs[i] = tinyConfig(t, b, run, fmt.Sprintf("train.zero=%d", c.zero), "checkpoint.layout="+c.layout)
		}
		res, logs := runRanks(t, n, cfgs, nil)
		if got := isSharded(res[0].Checkpoint); got != sharded {
			t.Errorf("%d ranks, ZeRO %d, layout %q: sharded checkpoint %v, want %v", n, c.zero, c.layout, got, sharded)
		}
		if sharded {
			for r := 0; r < n; r++ {
				if _, err := os.Stat(filepath.Join(res[0].Checkpoint, shardFile(r, n))); err != nil {
					t.Errorf("%d ranks, ZeRO %d: rank %d's shard: %v", n, c.zero, r, err)
				}
			}
			for _, f := range []string{"model.safetensors", "optimizer.safetensors"} {
				if _, err := os.Stat(filepath.Join(res[0].Checkpoint, f)); err == nil {
					t.Errorf("%d ranks, ZeRO %d: the sharded checkpoint holds a gathered %s", n, c.zero, f)
				}
			}
		}
		for i := range res {
			closeLosses(t, fmt.Sprintf("one process vs rank %d of %d, ZeRO %d", i, n, c.zero), one, res[i], 2e-5)
		}
		// The moments in rank 0's checkpoint are the one process's (under
		// ZeRO-1, gathered from the ranks' shards).
		closeMoments(t, fmt.Sprintf("%d ranks, ZeRO %d", n, c.zero), one.Checkpoint, res[0].Checkpoint, 1e-3)
		if c.zero == 1 && !strings.Contains(logs[0], "ZeRO stage 1: AdamW's moments sharded over") {
			t.Errorf("rank 0's log does not say the moments are sharded:\n%s", logs[0])
		}
		if c.zero >= 2 && !strings.Contains(logs[0], fmt.Sprintf("(ZeRO stage %d)", c.zero)) {
			t.Errorf("rank 0's log does not say what a rank holds at stage %d:\n%s", c.zero, logs[0])
		}
		if c.zero >= 2 || sharded {
			// The checkpoint's weights, gathered from the ranks' pieces
			// (or written as pieces by the ranks).
			closeWeights(t, fmt.Sprintf("%d ranks, ZeRO %d", n, c.zero), one.Checkpoint, res[0].Checkpoint, 1e-4)
		}
		if !strings.Contains(logs[0], "data parallel: ") {
			t.Errorf("rank 0's log does not say it runs data parallel:\n%s", logs[0])
		}
		if res[0].Checkpoint == "" {
			t.Errorf("rank 0 wrote no checkpoint")
		}
		for i := 1; i < n && !sharded; i++ {
			if m, _ := filepath.Glob(filepath.Join(cfgs[i].RunDir, "*")); len(m) > 0 {
				t.Errorf("rank %d wrote %v", i, m)
			}
		}
	}
}

// closeMoments fails unless the AdamW moments of checkpoints a and b agree
// within rel of each tensor's largest (either layout).
func closeMoments(t *testing.T, what, a, b string, rel float64) {
	t.Helper()
	_, ma := readCheckpoint(t, a)
	_, mb := readCheckpoint(t, b)
	closeTensors(t, what+" (moments)", ma, mb, rel)
}

// closeWeights is closeMoments for the checkpoints' weights.
func closeWeights(t *testing.T, what, a, b string, rel float64) {
	t.Helper()
	wa, _ := readCheckpoint(t, a)
	wb, _ := readCheckpoint(t, b)
	closeTensors(t, what+" (weights)", wa, wb, rel)
}

// readCheckpoint reads a checkpoint of either layout whole: its weights
// and its moments (exp_avg.NAME, exp_avg_sq.NAME) by name, through the
// loaders a resume uses.
func readCheckpoint(t *testing.T, dir string) (weights, moments map[string][]float32) {
	t.Helper()
	cfg, err := model.LoadConfig(dir)
	if err != nil {
		t.Fatal(err)
	}
	weights, moments = map[string][]float32{}, map[string][]float32{}
	var c *shardedCkpt
	var w *model.Weights
	if isSharded(dir) {
		if c, err = openSharded(dir); err != nil {
			t.Fatal(err)
		}
		defer c.close()
	} else {
		if w, err = model.OpenWeights(dir); err != nil {
			t.Fatal(err)
		}
		defer w.Close()
	}
	read, done, err := momentSource(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer done()
	for _, ts := range cfg.Tensors() {
		n := 1
		for _, d := range ts.Shape {
			n *= d
		}
		v := make([]float32, n)
		if c != nil {
			err = c.read(ts.Name, n, 0, v)
		} else {
			v, err = w.F32(ts.Name)
		}
		if err != nil {
			t.Fatalf("%s: %v", dir, err)
		}
		weights[ts.Name] = v
		for _, k := range []string{"exp_avg.", "exp_avg_sq."} {
			m := make([]float32, n)
			if err := read(k+ts.Name, n, 0, m); err != nil {
				t.Fatalf("%s: %v", dir, err)
			}
			moments[k+ts.Name] = m
		}
	}
	return weights, moments
}

// closeTensors fails unless the tensors a and b agree within rel of each
// tensor's largest.
func closeTensors(t *testing.T, what string, a, b map[string][]float32, rel float64) {
	t.Helper()
	if len(a) == 0 || len(a) != len(b) {
		t.Fatalf("%s: %d and %d tensors", what, len(a), len(b))
	}
	for name, x := range a {
		y, ok := b[name]
		if !ok || len(y) != len(x) {
			t.Fatalf("%s: %s has %d values and %d", what, name, len(x), len(y))
		}
		var big, worst float64
		for i := range x {
			big = math.Max(big, math.Abs(float64(x[i])))
			worst = math.Max(worst, math.Abs(float64(x[i]-y[i])))
		}
		if worst > rel*big {
			t.Fatalf("%s: %s differs by %g (largest value %g)", what, name, worst, big)
		}
	}
}

// TestDataParallelMoEAndQAD: a Qwen3-MoE student (its routing counts and
// load-balancing loss summed over the ranks) and an NVFP4 QAD student
// (calibrated on every rank alike) train on 2 ranks at ZeRO 1 and 3 as
// they do in one process.
func TestDataParallelMoEAndQAD(t *testing.T) {
	b := testCache(t)
	for _, c := range []struct {
		name string
		cfg  func(dir string, over ...string) *Config
	}{
		{"moe", func(dir string, over ...string) *Config {
			return moeConfig(t, b, dir, append(over, "train.max_steps=6")...)
		}},
		{"qad", func(dir string, over ...string) *Config {
			return tinyConfig(t, b, dir, append(over, "quant=nvfp4", "calib_batches=2", "train.max_steps=6")...)
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			one, err := Run(c.cfg(filepath.Join(t.TempDir(), "one")), Options{Log: &bytes.Buffer{}})
			if err != nil {
				t.Fatal(err)
			}
			if one.Steps[0].Rows < 2 {
				t.Fatalf("%d rows a step: the ranks would not share the steps", one.Steps[0].Rows)
			}
			dir := t.TempDir()
			for _, zero := range []int{1, 3} {
				z := fmt.Sprintf("train.zero=%d", zero)
				cfgs := []*Config{c.cfg(filepath.Join(dir, z), z), c.cfg(filepath.Join(dir, z), z)}
				res, _ := runRanks(t, 2, cfgs, nil)
				for i := range res {
					closeLosses(t, fmt.Sprintf("%s: one process vs rank %d of 2, ZeRO %d", c.name, i, zero), one, res[i], 1e-4)
					if c.name == "moe" && fmt.Sprint(res[i].Steps[0].ExpertShare) != fmt.Sprint(one.Steps[0].ExpertShare) {
						t.Errorf("ZeRO %d rank %d: step 1's expert shares %v, one process's %v", zero, i, res[i].Steps[0].ExpertShare, one.Steps[0].ExpertShare)
					}
				}
			}
		})
	}
}

// TestZeRO1Shards: the ranks' slices cover the arena once, cut at the
// tensors' boundaries into pieces that lie inside their tensors.
func TestZeRO1Shards(t *testing.T) {
	ts := []train.Tensor{{Name: "a", Off: 0, N: 10}, {Name: "b", Off: 10, N: 3}, {Name: "c", Off: 13, N: 20}}
	for _, size := range []int{1, 2, 3, 7, 40} {
		seen := make([]int, 33)
		per := (33 + size - 1) / size
		for r := 0; r < size; r++ {
			lo, hi := min(r*per, 33), min((r+1)*per, 33)
			for _, p := range piecesOf(ts, lo, hi) {
				tt := ts[p.Tensor]
				if p.Off < 0 || p.N <= 0 || p.Off+p.N > tt.N {
					t.Fatalf("size %d rank %d: piece %+v outside tensor %s", size, r, p, tt.Name)
				}
				for i := tt.Off + p.Off; i < tt.Off+p.Off+p.N; i++ {
					if i < lo || i >= hi {
						t.Fatalf("size %d rank %d: piece %+v leaves the slice [%d, %d)", size, r, p, lo, hi)
					}
					seen[i]++
				}
			}
		}
		for i, c := range seen {
			if c != 1 {
				t.Fatalf("size %d: parameter %d in %d slices", size, i, c)
			}
		}
	}
}

// TestDataParallelStopAndResume: a stop that reaches one rank only stops
// every rank at the same step boundary, rank 0 checkpoints it, and the
// group resumes from it to the same weights as an uninterrupted group.
func TestDataParallelStopAndResume(t *testing.T) {
	for _, zero := range []int{0, 1, 3} {
		t.Run(fmt.Sprintf("zero%d", zero), func(t *testing.T) { stopAndResume(t, zero) })
	}
}

func stopAndResume(t *testing.T, zero int) {
	b := testCache(t)
	dir := t.TempDir()
	z := fmt.Sprintf("train.zero=%d", zero)
	cfgs := func(run string) []*Config {
		return []*Config{tinyConfig(t, b, filepath.Join(dir, run), z), tinyConfig(t, b, filepath.Join(dir, run), z)}
	}
	straight, _ := runRanks(t, 2, cfgs("straight"), nil)

	stops := []chan struct{}{make(chan struct{}), make(chan struct{})}
	var once sync.Once
	testHookRow = func(step, row int) {
		if step == 5 && row == 1 { // rank 1's row of step 5
			once.Do(func() { close(stops[1]) })
		}
	}
	defer func() { testHookRow = nil }()
	first, _ := runRanks(t, 2, cfgs("stopped"), stops)
	testHookRow = nil
	for i, r := range first {
		if !r.Interrupted || r.Step != 5 {
			t.Fatalf("rank %d: interrupted %v at step %d, want both ranks stopped after step 5", i, r.Interrupted, r.Step)
		}
	}
	again, _ := runRanks(t, 2, cfgs("stopped"), nil)
	if again[0].Resumed == "" {
		t.Fatalf("the rerun did not resume")
	}
	last, want := again[0].Steps[len(again[0].Steps)-1], straight[0].Steps[len(straight[0].Steps)-1]
	if math.Float64bits(last.Loss) != math.Float64bits(want.Loss) || math.Float64bits(last.GradNorm) != math.Float64bits(want.GradNorm) {
		t.Errorf("the resumed group's last step: loss %v grad_norm %v; uninterrupted: %v %v", last.Loss, last.GradNorm, want.Loss, want.GradNorm)
	}
}

// childRank is the Options of a child process (TestMain's child): with
// TRAINER_CHILD_RANK=R/N and TRAINER_CHILD_NCCL_ID=HEX it is rank R of N
// of a data-parallel run joined through its backend's Collectives with
// that id (the parent made it, standing in for the rendezvous).
func childRank() (Options, error) {
	o := Options{Log: io.Discard}
	v := os.Getenv("TRAINER_CHILD_RANK")
	if v == "" {
		return o, nil
	}
	var rank, size int
	if _, err := fmt.Sscanf(v, "%d/%d", &rank, &size); err != nil {
		return o, fmt.Errorf("TRAINER_CHILD_RANK=%q: want R/N", v)
	}
	b, err := hex.DecodeString(os.Getenv("TRAINER_CHILD_NCCL_ID"))
	if err != nil || len(b) != len(compute.CollectiveID{}) {
		return o, fmt.Errorf("TRAINER_CHILD_NCCL_ID: want %d hex bytes (%v)", len(compute.CollectiveID{}), err)
	}
	var id compute.CollectiveID
	copy(id[:], b)
	o.Parallel = &Parallel{Rank: rank, WorldSize: size, Join: func(be compute.Backend) (compute.Collective, error) {
		cb, ok := be.(compute.Collectives)
		if !ok {
			return nil, fmt.Errorf("the %s backend has no collectives", be.Name())
		}
		return cb.JoinCollective(id, rank, size)
	}}
	return o, nil
}

// writeChildResult writes res as JSON to $TRAINER_CHILD_RESULT, if set.
func writeChildResult(res *Result) error {
	p := os.Getenv("TRAINER_CHILD_RESULT")
	if p == "" {
		return nil
	}
	b, err := json.Marshal(res)
	if err != nil {
		return err
	}
	return os.WriteFile(p, b, 0o644)
}

// TestCUDADataParallel: two ranks on the CUDA backend (the emulator, with
// its NCCL stand-in), each a process of its own (this test binary as
// TestMain's child) with its own device, joined through the backend's
// Collectives by an id this process makes (the rendezvous's job in
// student train): at ZeRO stages 0 to 3 they follow a one-process CUDA
// run's losses within fp32 reordering, rank 0's checkpoint holds its
// weights and moments, and rank 0 alone writes the run directory.
func TestCUDADataParallel(t *testing.T) {
	useCUDA(t)
	b := testCache(t)
	over := []string{"train.device=cuda", "train.max_steps=6", "eval.every=3"}
	one, err := Run(tinyConfig(t, b, filepath.Join(t.TempDir(), "one"), over...), Options{Log: &bytes.Buffer{}})
	if err != nil {
		t.Fatal(err)
	}
	for _, zero := range []int{0, 1, 2, 3} {
		cudaRanks(t, b, one, append(over, fmt.Sprintf("train.zero=%d", zero)))
	}
	// A group of one (NCCL with a single rank) and of four (more ranks
	// than the step has rows: one runs phantom passes at stage 3).
	if one.Steps[0].Rows >= 4 {
		t.Fatalf("%d rows a step: four ranks would all have rows", one.Steps[0].Rows)
	}
	mk := func(runDir string, over ...string) *Config { return tinyConfig(t, b, runDir, over...) }
	cudaRanksOf(t, mk, 1, one, append(over, "train.zero=2"))
	cudaRanksOf(t, mk, 4, one, append(over, "train.zero=3"))
}

// TestCUDADataParallelOneRank: a job of one rank process at each ZeRO
// stage, 0 to 3, follows the one-process run: on a GPU, NCCL for real
// through every stage at world size 1 (the GPU suite's train-zero step
// runs it); on the emulator, its NCCL stand-in.
func TestCUDADataParallelOneRank(t *testing.T) {
	useCUDA(t)
	b := testCache(t)
	over := []string{"train.device=cuda", "train.max_steps=4", "eval.every=2"}
	one, err := Run(tinyConfig(t, b, filepath.Join(t.TempDir(), "one"), over...), Options{Log: &bytes.Buffer{}})
	if err != nil {
		t.Fatal(err)
	}
	mk := func(runDir string, over ...string) *Config { return tinyConfig(t, b, runDir, over...) }
	for _, zero := range []int{0, 1, 2, 3} {
		cudaRanksOf(t, mk, 1, one, append(over, fmt.Sprintf("train.zero=%d", zero)))
	}
}

// TestCUDADataParallelMoEAndQAD: a Qwen3-MoE student at ZeRO 3 and an
// NVFP4 QAD student at ZeRO 2, each on two rank processes of the
// emulated GPU and NCCL, follow their one-process CUDA runs (the QAD
// calibration alike on every rank; the MoE routing counts summed).
func TestCUDADataParallelMoEAndQAD(t *testing.T) {
	useCUDA(t)
	b := testCache(t)
	over := []string{"train.device=cuda", "train.max_steps=4", "eval.every=2"}
	for _, c := range []struct {
		name string
		zero int
		mk   func(runDir string, over ...string) *Config
	}{
		{"moe", 3, func(runDir string, over ...string) *Config { return moeConfig(t, b, runDir, over...) }},
		{"qad", 2, func(runDir string, over ...string) *Config {
			return tinyConfig(t, b, runDir, append(over, "quant=nvfp4", "calib_batches=2")...)
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			one, err := Run(c.mk(filepath.Join(t.TempDir(), "one"), over...), Options{Log: &bytes.Buffer{}})
			if err != nil {
				t.Fatal(err)
			}
			cudaRanksOf(t, c.mk, 2, one, append(over, fmt.Sprintf("train.zero=%d", c.zero)))
		})
	}
}

// rankProc is a rank process of a CUDA data-parallel test (TestMain's
// child).
type rankProc struct {
	cmd    *exec.Cmd
	stderr *strings.Builder
	result string // where it writes its Result
}

// startRanks starts n rank processes of the config over in run directory
// dir/run, joined by a new group's id; env[r] are rank r's extra
// variables.
func startRanks(t *testing.T, b *testcache.Built, dir string, n int, over []string, env map[int][]string) []rankProc {
	t.Helper()
	return startRanksOf(t, func(runDir string, over ...string) *Config { return tinyConfig(t, b, runDir, over...) }, dir, n, over, env)
}

// startRanksOf is startRanks of the config mk makes.
func startRanksOf(t *testing.T, mk func(runDir string, over ...string) *Config, dir string, n int, over []string, env map[int][]string) []rankProc {
	t.Helper()
	be, err := cuda.Open(cuda.Options{KernelCache: os.Getenv("DISTILL_KERNEL_CACHE")})
	if err != nil {
		t.Fatal(err)
	}
	id, err := be.NewCollectiveID()
	be.Close()
	if err != nil {
		t.Fatal(err)
	}
	var ps []rankProc
	for rank := 0; rank < n; rank++ {
		cfg := mk(filepath.Join(dir, "run"), over...)
		cp := filepath.Join(dir, fmt.Sprintf("rank%d.yaml", rank))
		writeResolvedTo(t, cfg, cp)
		p := rankProc{cmd: exec.Command(os.Args[0], "-test.run=^$"), stderr: &strings.Builder{},
			result: filepath.Join(dir, fmt.Sprintf("rank%d.json", rank))}
		p.cmd.Env = append(os.Environ(), "TRAINER_CHILD_CONFIG="+cp, fmt.Sprintf("TRAINER_CHILD_RANK=%d/%d", rank, n),
			"TRAINER_CHILD_NCCL_ID="+hex.EncodeToString(id[:]), "TRAINER_CHILD_RESULT="+p.result)
		p.cmd.Env = append(p.cmd.Env, env[rank]...)
		p.cmd.Stderr = p.stderr
		if len(env[rank]) > 0 { // a held child waits on its stdin, which stays open
			if _, err := p.cmd.StdinPipe(); err != nil {
				t.Fatal(err)
			}
		}
		if err := p.cmd.Start(); err != nil {
			t.Fatal(err)
		}
		ps = append(ps, p)
	}
	return ps
}

// results waits for the ranks and reads their Results. On a real GPU
// machine with one device the ranks share it, which NCCL refuses
// ("Duplicate GPU detected"): the test then skips, quoting the refusal
// (a data-parallel run needs a GPU per rank; TestNCCLSingleRank checks
// the binding on one).
func results(t *testing.T, ps []rankProc) []Result {
	t.Helper()
	errs := make([]error, len(ps))
	for rank, p := range ps {
		errs[rank] = p.cmd.Wait()
	}
	for rank, p := range ps {
		if errs[rank] != nil && strings.Contains(p.stderr.String(), "Duplicate GPU detected") {
			line := p.stderr.String()
			if i := strings.Index(line, "ncclCommInitRank"); i >= 0 {
				line = line[i:]
			}
			if i := strings.IndexByte(line, '\n'); i >= 0 {
				line = line[:i]
			}
			t.Skipf("NCCL refused the ranks sharing this machine's GPU (rank %d): %s", rank, line)
		}
	}
	for rank, p := range ps {
		if errs[rank] != nil {
			t.Fatalf("rank %d: %v\n%s", rank, errs[rank], p.stderr.String())
		}
	}
	out := make([]Result, len(ps))
	for rank, p := range ps {
		raw, err := os.ReadFile(p.result)
		if err == nil {
			err = json.Unmarshal(raw, &out[rank])
		}
		if err != nil {
			t.Fatalf("rank %d's result: %v", rank, err)
		}
	}
	return out
}

// cudaRanks runs two rank processes of the config over, joined by a new
// group's id, and compares them with the one-process run one.
func cudaRanks(t *testing.T, b *testcache.Built, one *Result, over []string) {
	cudaRanksOf(t, func(runDir string, over ...string) *Config { return tinyConfig(t, b, runDir, over...) }, 2, one, over)
}

// cudaRanksOf is cudaRanks of n ranks of the config mk makes.
func cudaRanksOf(t *testing.T, mk func(runDir string, over ...string) *Config, n int, one *Result, over []string) {
	rs := results(t, startRanksOf(t, mk, t.TempDir(), n, over, nil))
	for rank := 0; rank < n; rank++ {
		res := rs[rank]
		closeLosses(t, fmt.Sprintf("one CUDA process vs CUDA rank %d of %d (%v)", rank, n, over), one, &res, 1e-4)
		if rank == 0 {
			closeMoments(t, fmt.Sprintf("%v", over), one.Checkpoint, res.Checkpoint, 1e-3)
			closeWeights(t, fmt.Sprintf("%v", over), one.Checkpoint, res.Checkpoint, 1e-4)
			last := len(one.Steps) - 1
			t.Logf("%v, %d ranks: step %d: loss %.6f one process, %.6f rank 0; checkpoint %s", over, n, one.Steps[last].Step, one.Steps[last].Loss, res.Steps[last].Loss, res.Checkpoint)
		}
	}
}

// TestCUDADataParallelRankKilled: rank 0 of two rank processes on the
// emulated GPU and NCCL, at ZeRO 0 and at ZeRO 2 (sharded checkpoints),
// is killed (SIGKILL) in step 4; rank 1, waiting in
// the step's all-reduce, fails instead of hanging (the NCCL stand-in sees
// its peer gone), and the job run again resumes from rank 0's last
// checkpoint (step 2) and ends bit for bit where an uninterrupted pair
// ends.
func TestCUDADataParallelRankKilled(t *testing.T) {
	useCUDA(t)
	b := testCache(t)
	// ZeRO 0 (rank 0 writes the checkpoints) and 2 (each rank its shard),
	// killed in step 4; and at ZeRO 2 killed while it publishes step 4's
	// checkpoint, every shard durable but no manifest renamed into place.
	for _, c := range []struct {
		zero int
		hold string
	}{{0, "TRAINER_CHILD_HOLD"}, {2, "TRAINER_CHILD_HOLD"}, {2, "TRAINER_CHILD_HOLD_SAVE"}} {
		t.Run(fmt.Sprintf("zero%d/%s", c.zero, c.hold), func(t *testing.T) { rankKilled(t, b, c.zero, c.hold) })
	}
}

func rankKilled(t *testing.T, b *testcache.Built, zero int, hold string) {
	over := []string{"train.device=cuda", "train.max_steps=6", "eval.every=0", "checkpoint.every=2", "checkpoint.keep=5", fmt.Sprintf("train.zero=%d", zero)}
	straight := results(t, startRanks(t, b, t.TempDir(), 2, over, nil))

	dir := t.TempDir()
	held := filepath.Join(dir, "held")
	ps := startRanks(t, b, dir, 2, over, map[int][]string{0: {hold + "=4:" + held}})
	exited := make(chan error, 2)
	for _, p := range ps {
		go func(p rankProc) { exited <- p.cmd.Wait() }(p)
	}
	for { // until rank 0 holds in step 4 (go test's -timeout bounds a hang)
		if _, err := os.Stat(held); err == nil {
			break
		}
		select {
		case err := <-exited:
			t.Fatalf("a rank exited before rank 0 held: %v\nrank 0:\n%s\nrank 1:\n%s", err, ps[0].stderr, ps[1].stderr)
		case <-time.After(20 * time.Millisecond):
		}
	}
	ps[0].cmd.Process.Kill()
	var errs []error
	for range ps {
		errs = append(errs, <-exited)
	}
	for i, err := range errs {
		if err == nil {
			t.Errorf("exit %d of the killed pair: nil, want both ranks to fail", i)
		}
	}
	why := regexp.MustCompile(`(?m)^panic: .*$`).FindString(ps[1].stderr.String())
	if !strings.Contains(why, "nccl") || !strings.Contains(why, "rank 0") {
		t.Errorf("rank 1 did not fail on its NCCL peer's death:\n%s", lastLines(ps[1].stderr.String(), 20))
	}
	t.Logf("rank 1 after its peer's death: %s", why)

	again := results(t, startRanks(t, b, dir, 2, over, nil))
	if again[0].Resumed == "" || !strings.HasSuffix(again[0].Resumed, "step-00000002") {
		t.Fatalf("the rerun resumed from %q, want step 2's checkpoint", again[0].Resumed)
	}
	if isSharded(again[0].Resumed) != (zero > 0) {
		t.Fatalf("ZeRO %d: the checkpoint %s is sharded: %v", zero, again[0].Resumed, isSharded(again[0].Resumed))
	}
	if tmp, _ := filepath.Glob(filepath.Join(dir, "run", "checkpoints", ".tmp-*")); len(tmp) > 0 {
		t.Errorf("the killed save's temporary directory stays after the rerun: %v", tmp)
	}
	for rank := range again {
		last, want := again[rank].Steps[len(again[rank].Steps)-1], straight[rank].Steps[len(straight[rank].Steps)-1]
		if math.Float64bits(last.Loss) != math.Float64bits(want.Loss) || math.Float64bits(last.GradNorm) != math.Float64bits(want.GradNorm) {
			t.Errorf("rank %d: the resumed pair's last step: loss %v grad_norm %v; uninterrupted: %v %v", rank, last.Loss, last.GradNorm, want.Loss, want.GradNorm)
		}
	}
}

// lastLines is the last n lines of s.
func lastLines(s string, n int) string {
	l := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return strings.Join(l[max(0, len(l)-n):], "\n")
}

// TestResumeAcrossWorldSizes: a checkpoint is the same whatever wrote it:
// two ranks at ZeRO 1 (and at ZeRO 3) stop after step 5 and one process
// resumes their checkpoint, and one process stops after step 4 and three
// ranks at ZeRO 1 (3) resume it (each taking its slice of the moments, at
// stage 3 its part of the weights too); both end where one uninterrupted
// process ends, within fp32 reordering.
func TestResumeAcrossWorldSizes(t *testing.T) {
	b := testCache(t)
	straight, err := Run(tinyConfig(t, b, filepath.Join(t.TempDir(), "straight")), Options{Log: &bytes.Buffer{}})
	if err != nil {
		t.Fatal(err)
	}
	want := straight.Steps[len(straight.Steps)-1]
	stopAt5 := func(stop chan struct{}) func(step, row int) {
		var once sync.Once
		return func(step, row int) {
			if step == 5 {
				once.Do(func() { close(stop) })
			}
		}
	}
	check := func(what string, res *Result) {
		t.Helper()
		if res.Resumed == "" {
			t.Fatalf("%s: did not resume", what)
		}
		last := res.Steps[len(res.Steps)-1]
		if last.Step != want.Step || math.Abs(last.Loss-want.Loss) > 1e-4*want.Loss || math.Abs(last.GradNorm-want.GradNorm) > 1e-3*want.GradNorm {
			t.Errorf("%s: last step %d loss %v grad_norm %v; one uninterrupted process: step %d %v %v", what, last.Step, last.Loss, last.GradNorm, want.Step, want.Loss, want.GradNorm)
		}
		// The moments carried over: the final ones are the straight run's
		// (every rank's Result names the checkpoint rank 0 wrote).
		closeMoments(t, what, straight.Checkpoint, res.Checkpoint, 1e-3)
	}

	for _, zero := range []int{1, 3} {
		z := fmt.Sprintf("train.zero=%d", zero)
		// Two ranks, then one process.
		dir := filepath.Join(t.TempDir(), "a")
		stops := []chan struct{}{make(chan struct{}), make(chan struct{})}
		testHookRow = stopAt5(stops[0])
		runRanks(t, 2, []*Config{tinyConfig(t, b, dir, z), tinyConfig(t, b, dir, z)}, stops)
		testHookRow = nil
		one, err := Run(tinyConfig(t, b, dir), Options{Log: &bytes.Buffer{}})
		if err != nil {
			t.Fatal(err)
		}
		check(fmt.Sprintf("2 ranks at ZeRO %d, resumed by one process", zero), one)

		// One process, then three ranks.
		dir = filepath.Join(t.TempDir(), "b")
		stop := make(chan struct{})
		testHookRow = stopAt5(stop)
		// One process abandons step 5 for the stop: it saves step 4.
		if r, err := Run(tinyConfig(t, b, dir), Options{Log: &bytes.Buffer{}, Stop: stop}); err != nil || !r.Interrupted || r.Step != 4 {
			t.Fatalf("the first process: %v, want it interrupted after step 4", err)
		}
		testHookRow = nil
		cfgs := []*Config{tinyConfig(t, b, dir, z), tinyConfig(t, b, dir, z), tinyConfig(t, b, dir, z)}
		res, _ := runRanks(t, 3, cfgs, nil)
		for i := range res {
			check(fmt.Sprintf("one process, resumed by rank %d of 3 at ZeRO %d", i, zero), res[i])
		}
	}
}
