package cuda

import (
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"

	"distill/compute"
	"distill/infer"
	"distill/model/decoder"
)

// A pipelined teacher (infer.LoadStages) on the emulator's several GPUs,
// and two stages on one GPU: the suite's pipe step runs the latter, and
// the benchmark, on a real GPU (the machine has one).

// pipeLayouts are the GPU ordinals of each stage: on the emulator, two
// and three GPUs and two stages sharing GPU 0; on a GPU, the last only.
func pipeLayouts() [][]int {
	if onGPU() {
		return [][]int{{0, 0}}
	}
	return [][]int{{0, 1}, {1, 0}, {0, 1, 2}, {0, 0}}
}

// pipeGPUs opens backends on the emulator's three GPUs (on a GPU: GPU 0),
// and a second one on GPU 0, closed with t; stages takes them by ordinal,
// a repeated ordinal the second backend.
type pipeGPUs struct{ gpu, second []compute.Backend }

func openPipeGPUs(t *testing.T) *pipeGPUs {
	t.Helper()
	g := &pipeGPUs{}
	n := 3
	if onGPU() {
		n = 1
	}
	for o := 0; o < n; o++ {
		g.gpu = append(g.gpu, openOn(t, o, t.Logf))
		g.second = append(g.second, openOn(t, o, t.Logf))
	}
	return g
}

func (g *pipeGPUs) stages(ords []int) []compute.Backend {
	var bes []compute.Backend
	seen := map[int]bool{}
	for _, o := range ords {
		if seen[o] {
			bes = append(bes, g.second[o])
		} else {
			bes = append(bes, g.gpu[o])
		}
		seen[o] = true
	}
	return bes
}

// usePipeEmu points the test at the emulator with three GPUs (or at the
// real GPU).
func usePipeEmu(t *testing.T) {
	t.Helper()
	if !onGPU() {
		useEmu(t)
		t.Setenv("DISTILL_EMU_DEVICES", "3")
	}
}

// TestPipelineGoldens: the golden checkpoints split over two and three
// emulated GPUs (in either order), and over two stages sharing GPU 0,
// give the one-GPU teacher's top-k bit for bit: the same kernels, only
// their placement changed. In one micro-batch the whole batch's; cut
// into micro-batches, the one-GPU teacher's of each micro-batch. The
// copies between GPUs go peer to peer, and through pinned host memory
// with the emulator's peer access off. Sampled targets (ForwardDraws)
// too. Temperatures other than the first run's, on two GPUs only (it
// changes the last stage's norm weight alone).
func TestPipelineGoldens(t *testing.T) {
	usePipeEmu(t)
	gpus := openPipeGPUs(t)
	for _, dir := range goldenDirs(t) {
		name := filepath.Base(dir)
		var g goldenFile
		b, err := os.ReadFile(filepath.Join(dir, "golden.json"))
		if err != nil {
			t.Fatal(err)
		}
		if err := json.Unmarshal(b, &g); err != nil {
			t.Fatal(err)
		}
		one, err := infer.Load(dir, gpus.gpu[0])
		if err != nil {
			t.Fatal(err)
		}
		ref := newPipeRef(one, g)
		for _, ords := range pipeLayouts() {
			if len(ords) > one.Cfg.Layers || (ords[0] == 1 && name != "qwen3") {
				continue
			}
			for _, peer := range []string{"1", "0"} {
				if peer == "0" && (onGPU() || ords[0] == ords[1] || name != "qwen3") {
					continue
				}
				t.Run(fmt.Sprintf("%s/gpus=%v/peer=%s", name, ords, peer), func(t *testing.T) {
					t.Setenv("DISTILL_EMU_PEER", peer)
					for _, mb := range []int{1, 3} {
						m, err := infer.LoadStages(dir, gpus.stages(ords), infer.LoadOptions{MicroBatches: mb, MinMicroTokens: 1})
						if err != nil {
							t.Fatal(err)
						}
						temps := g.Runs[:1]
						if slices.Equal(ords, []int{0, 1}) || onGPU() {
							temps = g.Runs
						}
						for _, run := range temps {
							ids, lps := m.Forward(g.Samples, g.K, run.Temperature)
							want := ref.topK(m.Cut(g.Samples), run.Temperature)
							if len(m.Cut(g.Samples)) != mb || !slices.Equal(ids, want.ids) || !slices.Equal(lps, want.lps) {
								t.Errorf("%d micro-batches (cut %v), T=%v: the pipelined top-k differs from one GPU's", mb, m.Cut(g.Samples), run.Temperature)
							}
						}
						if name == "qwen3" && mb == 3 && peer == "1" {
							pipeDrawsCheck(t, one, m, g.Samples)
						}
						m.Free()
					}
				})
			}
		}
		one.Free()
	}
}

// TestPipelineFP8: a teacher with FP8 weights (--weights fp8) split over
// two emulated GPUs gives the one-GPU FP8 teacher's top-k bit for bit.
func TestPipelineFP8(t *testing.T) {
	usePipeEmu(t)
	gpus := openPipeGPUs(t)
	dir := "../../infer/testdata/golden/qwen3_moe"
	one, err := infer.LoadWith(dir, gpus.gpu[0], infer.LoadOptions{Weights: infer.WeightsFP8})
	if err != nil {
		t.Fatal(err)
	}
	defer one.Free()
	ords := []int{0, 1}
	if onGPU() {
		ords = []int{0, 0}
	}
	m, err := infer.LoadStages(dir, gpus.stages(ords), infer.LoadOptions{Weights: infer.WeightsFP8, MicroBatches: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Free()
	if m.Fingerprint() != one.Fingerprint() {
		t.Errorf("fingerprints differ: %s, %s", m.Fingerprint(), one.Fingerprint())
	}
	samples := [][]int32{{1, 2, 3, 4, 5, 6, 7, 8, 9}, {11, 12}, {40, 41, 42, 43}}
	wantIDs, wantLPs := one.Forward(samples, 8, 1)
	ids, lps := m.Forward(samples, 8, 1)
	if !slices.Equal(ids, wantIDs) || !slices.Equal(lps, wantLPs) {
		t.Errorf("the pipelined FP8 teacher's top-k differs from one GPU's")
	}
}

// pipeRef is the one-GPU teacher's top-k of the golden samples cut into
// micro-batches, computed once per cut and temperature.
type pipeRef struct {
	one  *infer.Model
	g    goldenFile
	done map[string]topK
}

type topK struct {
	ids []int32
	lps []float32
}

func newPipeRef(one *infer.Model, g goldenFile) *pipeRef {
	return &pipeRef{one: one, g: g, done: map[string]topK{}}
}

func (r *pipeRef) topK(runs [][2]int, temp float32) topK {
	key := fmt.Sprint(runs, temp)
	if v, ok := r.done[key]; ok {
		return v
	}
	var v topK
	for _, run := range runs {
		i, l := r.one.Forward(r.g.Samples[run[0]:run[1]], r.g.K, temp)
		v.ids, v.lps = append(v.ids, i...), append(v.lps, l...)
	}
	r.done[key] = v
	return v
}

// pipeDrawsCheck compares the pipelined teacher's head+sampled draws with
// one GPU's of each micro-batch.
func pipeDrawsCheck(t *testing.T, one, m *infer.Model, samples [][]int32) {
	d := infer.Draws{N: 40, Head: true, U: func(s, p, i int) float64 { return float64((s*131+p*17+i*7)%512) / 512 }}
	ids, lps, res := m.ForwardDraws(samples, 4, 1, d)
	var wIDs []int32
	var wLPs []float32
	var w infer.DrawResult
	for _, r := range m.Cut(samples) {
		dd := d
		dd.U = func(s, p, i int) float64 { return d.U(r[0]+s, p, i) }
		i, l, x := one.ForwardDraws(samples[r[0]:r[1]], 4, 1, dd)
		wIDs, wLPs = append(wIDs, i...), append(wLPs, l...)
		w.N, w.IDs, w.Counts, w.Tail = append(w.N, x.N...), append(w.IDs, x.IDs...), append(w.Counts, x.Counts...), append(w.Tail, x.Tail...)
	}
	if !slices.Equal(ids, wIDs) || !slices.Equal(lps, wLPs) || !slices.Equal(res.N, w.N) || !slices.Equal(res.IDs, w.IDs) ||
		!slices.Equal(res.Counts, w.Counts) || !slices.Equal(res.Tail, w.Tail) || len(res.IDs) == 0 {
		t.Errorf("head+sampled draws: the pipeline's differ from one GPU's")
	}
}

// TestPipelineOutOfMemoryOnLoad: a GPU whose memory runs out while its
// stage loads fails the load with an error naming it, its stage's layers
// and what it had free, and leaves every GPU's memory as it was before.
// The same teacher then loads onto GPUs that hold it, and a token budget
// too large for the second GPU is refused naming that GPU.
func TestPipelineOutOfMemoryOnLoad(t *testing.T) {
	if onGPU() {
		t.Skip("shrinks an emulated GPU")
	}
	usePipeEmu(t)
	dir := "../../infer/testdata/golden/qwen3"
	bes := openPipeGPUs(t).stages([]int{0, 1})
	used := func(i int) int64 {
		free, total := bes[i].(compute.DeviceMemory).MemInfo()
		return total - free
	}
	before0, before1 := used(0), used(1)
	m, err := infer.LoadStages(dir, bes, infer.LoadOptions{})
	if err != nil {
		t.Fatal(err)
	}
	stage1 := used(1) - before1 // its weights
	m.Free()
	if used(0) != before0 || used(1) != before1 {
		t.Fatalf("freeing the teacher left %d and %d bytes on the GPUs", used(0)-before0, used(1)-before1)
	}
	t.Setenv("DISTILL_EMU_DEVICE_MEM_1", fmt.Sprint(before1+stage1/2))
	_, err = infer.LoadStages(dir, bes, infer.LoadOptions{})
	t.Logf("%v", err)
	if !errors.Is(err, infer.ErrDeviceMemory) || !errors.Is(err, compute.ErrOutOfMemory) ||
		!strings.HasPrefix(err.Error(), dir+": GPU 1 (distill CPU emulator) (pipeline stage of layer 1, norm, LM head): loading ") ||
		!strings.Contains(err.Error(), " ran out of memory (") || !strings.Contains(err.Error(), "; it had ") || strings.Count(err.Error(), "ran out of memory") != 1 ||
		!strings.Contains(err.Error(), "--devices") {
		t.Fatalf("GPU 1 out of memory mid-load: %v", err)
	}
	if used(0) != before0 || used(1) != before1 {
		t.Errorf("the failed load left %d and %d bytes on the GPUs", used(0)-before0, used(1)-before1)
	}
	t.Setenv("DISTILL_EMU_DEVICE_MEM_1", "")
	m, err = infer.LoadStages(dir, bes, infer.LoadOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := m.CheckDeviceFit(1000, 1000, 8, 0); err != nil {
		t.Fatalf("16 GiB emulated GPUs: %v", err)
	}
	t.Setenv("DISTILL_EMU_DEVICE_MEM_1", fmt.Sprint(used(1)+256<<20+m.StageDeviceBytes(1, 300, 300, 8, 0)))
	err = m.CheckDeviceFit(1000, 1000, 8, 0)
	t.Logf("%v", err)
	if !errors.Is(err, infer.ErrDeviceMemory) || !strings.Contains(err.Error(), "GPU 1 (distill CPU emulator) (pipeline stage of layer 1, norm, LM head): a forward of 1000 tokens") ||
		!strings.Contains(err.Error(), "lower --token-budget to") {
		t.Fatalf("a budget GPU 1 cannot hold: %v", err)
	}
}

// TestPipelineDeviceBytes: on each of two emulated GPUs, the device
// memory a pipelined forward takes beside the weights (the pool's
// high-water mark) is within its stage's bound (StageDeviceBytes: the
// activations, the hand-off on the first, the LM head's scratch on the
// last), which is not loose in one micro-batch (at most twice the
// measurement); cut into micro-batches it holds less.
func TestPipelineDeviceBytes(t *testing.T) {
	if onGPU() {
		t.Skip("two GPUs: emulated only")
	}
	usePipeEmu(t)
	gpus := openPipeGPUs(t)
	bes := gpus.stages([]int{0, 1})
	r := rand.New(rand.NewPCG(1, 2))
	lens, k := []int{61, 3, 17, 1, 40}, 16
	for _, mb := range []int{1, 3} {
		m, err := infer.LoadStages("../../infer/testdata/golden/qwen3", bes, infer.LoadOptions{MicroBatches: mb, MinMicroTokens: 1})
		if err != nil {
			t.Fatal(err)
		}
		m.Forward([][]int32{{0}}, 1, 1) // the copies of weights the backends keep from their first use
		samples, tokens, maxLen := make([][]int32, len(lens)), 0, 0
		for i, n := range lens {
			samples[i] = make([]int32, n)
			for j := range samples[i] {
				samples[i][j] = int32(r.IntN(m.Cfg.VocabSize))
			}
			tokens, maxLen = tokens+n, max(maxLen, n)
		}
		base := make([]int64, 2)
		for i, be := range bes {
			be.(*Backend).ResetPeakMemory()
			base[i] = be.(*Backend).PeakMemory()
		}
		m.Forward(samples, k, 1)
		for i, be := range bes {
			got := be.(*Backend).PeakMemory() - base[i]
			bound := m.StageDeviceBytes(i, tokens, maxLen, k, 0)
			t.Logf("%d micro-batches: GPU %d: peak %d bytes beside the weights, bound %d (%.2fx)", mb, i, got, bound, float64(bound)/float64(got))
			if got > bound || (mb == 1 && bound > 2*got) {
				t.Errorf("%d micro-batches: GPU %d took %d bytes beside its weights; its stage's bound is %d", mb, i, got, bound)
			}
		}
		// Forwards back to back (a stage takes the next while the later
		// ones finish this one; temperatures other than 1 make the last
		// stage's norm weight): the same bound holds.
		for i, be := range bes {
			be.(*Backend).ResetPeakMemory()
			base[i] = be.(*Backend).PeakMemory()
		}
		var waits []func() ([]int32, []float32)
		for f := 0; f < 4; f++ {
			waits = append(waits, m.StartForward(samples, k, 0.5+float32(f)/4))
		}
		for _, w := range waits {
			w()
		}
		for i, be := range bes {
			got := be.(*Backend).PeakMemory() - base[i]
			bound := m.StageDeviceBytes(i, tokens, maxLen, k, 0)
			t.Logf("%d micro-batches, 4 forwards back to back: GPU %d: peak %d bytes beside the weights, bound %d", mb, i, got, bound)
			if got > bound {
				t.Errorf("%d micro-batches, forwards back to back: GPU %d took %d bytes beside its weights; its stage's bound is %d", mb, i, got, bound)
			}
		}
		m.Free()
	}
}

// TestPipelineStageOutOfMemory: a stage whose GPU runs out of memory in
// the middle of a pipelined forward (the emulator's GPU shrunk to what is
// in use plus a fraction of a micro-batch's activations) fails the
// forward with an error naming the stage, its layers and its GPU, and
// wrapping the out-of-memory error; every GPU's memory comes back to
// what it was before the forward, the other stage's too. The forwards
// started after it, on a GPU given its memory back, give the one-GPU
// teacher's top-k of their micro-batches.
func TestPipelineStageOutOfMemory(t *testing.T) {
	if onGPU() {
		t.Skip("shrinks an emulated GPU")
	}
	usePipeEmu(t)
	gpus := openPipeGPUs(t)
	dir := "../../infer/testdata/golden/qwen3"
	one, err := infer.Load(dir, gpus.gpu[2])
	if err != nil {
		t.Fatal(err)
	}
	defer one.Free()
	bes := gpus.stages([]int{0, 1})
	m, err := infer.LoadStages(dir, bes, infer.LoadOptions{MicroBatches: 3, MinMicroTokens: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Free()
	m.Forward([][]int32{{0}}, 1, 1) // the copies of weights the backends keep from their first use
	used := func(i int) int64 {
		free, total := bes[i].(compute.DeviceMemory).MemInfo()
		return total - free
	}
	r := rand.New(rand.NewPCG(5, 6))
	samples := make([][]int32, 6)
	for i := range samples {
		samples[i] = make([]int32, 20+7*i)
		for j := range samples[i] {
			samples[i][j] = int32(r.IntN(m.Cfg.VocabSize))
		}
	}
	// Each stage keeps its RoPE table between forwards, grown to the
	// longest sample yet: a forward of these samples first, so that the
	// memory in use before a failing forward is what it leaves.
	m.Forward(samples, 8, 0.7)
	// At most half the plan's bound: with 6/8 of it, stage 0 fitted the
	// forward in about 1 run of 6 (how many hand-offs it holds at once
	// depends on how soon stage 1 takes them: the schedule), and the
	// test failed; with 5/8 it ran out of memory in each of 20 tries, 4/8 leaves
	// room beyond that.
	for _, c := range []struct{ s, frac int }{{1, 2}, {1, 3}, {1, 4}, {0, 2}, {0, 3}, {0, 4}} {
		s := c.s
		t.Run(fmt.Sprintf("stage%d/room%d", s, c.frac), func(t *testing.T) {
			before := []int64{used(0), used(1)}
			// A fraction of a micro-batch's need (about 75 tokens): the
			// forward fails at one allocation or another, in the decoder
			// or inside a kernel's call (its scratch).
			room := m.StageDeviceBytes(s, 75, 55, 8, 0) * int64(c.frac) / 8
			t.Setenv(fmt.Sprintf("DISTILL_EMU_DEVICE_MEM_%d", s), fmt.Sprint(before[s]+room))
			func() {
				defer func() {
					r := recover()
					err, ok := r.(error)
					t.Logf("%v", r)
					want := fmt.Sprintf("pipeline stage %d (layers %d-%d) on GPU %d (distill CPU emulator)", s, s, s, s)
					if !ok || !errors.Is(err, compute.ErrOutOfMemory) || !strings.Contains(err.Error(), want) {
						t.Errorf("panic %v, want an out-of-memory error naming %q", r, want)
					}
				}()
				m.Forward(samples, 8, 0.7)
			}()
			for i := range bes {
				if u := used(i); u != before[i] {
					t.Errorf("the failed forward left %d bytes on GPU %d", u-before[i], i)
				}
			}
			t.Setenv(fmt.Sprintf("DISTILL_EMU_DEVICE_MEM_%d", s), "")
			w1, w2 := m.StartForward(samples, 8, 0.7), m.StartForward(samples[2:], 8, 1)
			for i, c := range []struct {
				wait    func() ([]int32, []float32)
				samples [][]int32
				temp    float32
			}{{w1, samples, 0.7}, {w2, samples[2:], 1}} {
				ids, lps := c.wait()
				var wIDs []int32
				var wLPs []float32
				for _, run := range m.Cut(c.samples) {
					a, b := one.Forward(c.samples[run[0]:run[1]], 8, c.temp)
					wIDs, wLPs = append(wIDs, a...), append(wLPs, b...)
				}
				if !slices.Equal(ids, wIDs) || !slices.Equal(lps, wLPs) {
					t.Errorf("forward %d after the failure: the pipelined top-k differs from one GPU's", i)
				}
			}
		})
	}
}

// pipeBatches is the batches BenchmarkPipelineOneGPU runs back to back.
const pipeBatches = 4

// schedule writes a pipeline's trace as "0:1.2>" (stage 0 starts forward
// 1's micro-batch 2) and "<" (ends), in the order the events came.
func schedule(evs []decoder.TraceEvent) string {
	var sb strings.Builder
	for _, e := range evs {
		mark := ">"
		if e.End {
			mark = "<"
		}
		fmt.Fprintf(&sb, "%d:%d.%d%s ", e.Stage, e.Forward, e.Micro, mark)
	}
	return sb.String()
}

// BenchmarkPipelineOneGPU: the teacher's forward as one stage against two
// pipeline stages sharing one GPU (two backends, each its stream), on
// Qwen3-0.6B-shaped random weights (DISTILL_BENCH_SHAPES picks others),
// a packed batch of DISTILL_BENCH_TOKENS tokens (16384) of log-normal
// lengths, k = 64: in one micro-batch (the cost of the placement alone:
// the hand-off copies, ordered by events) and in the default
// micro-batches (what a pipeline on two GPUs would run, here with both
// stages competing for one GPU). Then pipeBatches such batches: one stage
// running them one after the other, two stages running each alone (the
// pipeline fills and drains for every batch) and two stages with the
// batches started back to back, two in flight (as teacherd keeps them:
// the first stage takes the next batch while the second finishes this
// one); cross_batch_starts counts how often the first stage did. Reports
// tokens/s of each, and overhead_% against the one stage measured in the
// same run; checks that each pipelined forward is bit for bit the one
// stage's of the same micro-batches. On one GPU the two stages share its
// SMs, so this measures the pipeline's cost, not the speed-up of two
// GPUs. With DISTILL_BENCH_OUT, one JSON line to pipeline-bench.jsonl.
// DISTILL_PIPE_BENCH_DRYRUN=1 runs it on the emulator on a tiny shape,
// where it only shows the schedule (logged with -test.benchtime 1x).
func BenchmarkPipelineOneGPU(b *testing.B) {
	shape := benchShapes[0]
	tokens := 16384
	if v, err := strconv.Atoi(os.Getenv("DISTILL_BENCH_TOKENS")); err == nil {
		tokens = v
	}
	if onGPU() {
		if only := os.Getenv("DISTILL_BENCH_SHAPES"); only != "" {
			for _, s := range benchShapes {
				if strings.Contains(only, s.Name) {
					shape = s
					break
				}
			}
		}
	} else if os.Getenv("DISTILL_PIPE_BENCH_DRYRUN") == "1" {
		useEmu(b)
		shape = benchShape{Name: "tiny", Vocab: 300, Hidden: 64, Layers: 4, Heads: 4, KVHeads: 2, HD: 16, Inter: 96, Tied: true}
		tokens = 600
	} else {
		b.Skip("needs a GPU (DISTILL_CUDA_TEST=gpu), or DISTILL_PIPE_BENCH_DRYRUN=1 for the emulator")
	}
	open := func() *Backend {
		be, err := Open(Options{KernelCache: kernelCacheForTests(b)})
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { be.Close() })
		return be
	}
	a0, a1 := open(), open()
	whole := newBenchModel(a0, shape)
	cfg := shape.config()
	split := infer.SplitLayers(cfg, 2, infer.WeightsBF16)
	s0, s1 := newBenchStage(a0, shape, 0, split[0].EndLayer, false), newBenchStage(a1, shape, split[0].EndLayer, shape.Layers, false)
	r := rand.New(rand.NewPCG(6, 6))
	var samples [][]int32
	n := 0
	for _, l := range benchWorkloads(tokens)["b"] {
		smp := make([]int32, l)
		for j := range smp {
			smp[j] = int32(r.IntN(shape.Vocab))
		}
		samples, n = append(samples, smp), n+l
	}
	if !onGPU() { // the dry run's few tokens: six samples
		samples, n = nil, 0
		for i := 0; i < 6; i++ {
			smp := make([]int32, tokens/6)
			for j := range smp {
				smp[j] = int32(r.IntN(shape.Vocab))
			}
			samples, n = append(samples, smp), n+len(smp)
		}
	}
	single := &decoder.Pipeline{Stages: []*decoder.Model{whole.Model}}
	secs := map[string]float64{}
	exact := map[string]bool{}
	for _, c := range []struct {
		name string
		mb   int
	}{{"one_stage", 1}, {"two_stages_one_microbatch", 1}, {"two_stages_microbatched", 0}} {
		p := single
		if c.name != "one_stage" {
			var err error
			if p, err = decoder.NewPipeline([]*decoder.Model{s0.Model, s1.Model}); err != nil {
				b.Fatal(err)
			}
			p.MicroBatches = c.mb
		}
		b.Run(c.name, func(b *testing.B) {
			ids, lps := p.TopK(samples, 64, 1) // warm up, and the exactness check
			if c.name != "one_stage" {
				var wIDs []int32
				var wLPs []float32
				for _, run := range p.Cut(samples) {
					i, l := single.TopK(samples[run[0]:run[1]], 64, 1)
					wIDs, wLPs = append(wIDs, i...), append(wLPs, l...)
				}
				exact[c.name] = slices.Equal(ids, wIDs) && slices.Equal(lps, wLPs)
				if !exact[c.name] {
					b.Errorf("%s: the pipelined forward differs from the one stage's of the same micro-batches", c.name)
				}
			}
			a0.wait()
			a1.wait()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				p.TopK(samples, 64, 1)
			}
			b.StopTimer()
			sec := b.Elapsed().Seconds() / float64(b.N)
			secs[c.name] = sec
			b.ReportMetric(float64(n)/sec, "tokens/s")
			b.ReportMetric(float64(len(p.Cut(samples))), "microbatches")
			if base := secs["one_stage"]; base > 0 && c.name != "one_stage" {
				b.ReportMetric(100*(sec-base)/base, "overhead_%")
			}
		})
	}
	// Several batches (pipeBatches, each the samples above rotated, so
	// that each is cut differently), in the default micro-batches: each
	// forward run alone, filling and draining the pipeline (what the
	// daemon did before it kept a forward a stage in flight), and the
	// same forwards started back to back, two in flight as serve's
	// batcher keeps them. The first stage's trace says how often it took
	// the next batch while the second still worked on the one before
	// (cross_batch_starts; at most pipeBatches-1) and, on the emulator,
	// the schedule is logged. Overhead against one stage running the same
	// batches one after the other.
	batches := make([][][]int32, pipeBatches)
	for i := range batches {
		r := len(samples) * i / pipeBatches
		batches[i] = append(append([][]int32{}, samples[r:]...), samples[:r]...)
	}
	p, err := decoder.NewPipeline([]*decoder.Model{s0.Model, s1.Model})
	if err != nil {
		b.Fatal(err)
	}
	if !onGPU() {
		p.MinMicroTokens = 1 // the tiny batches in micro-batches too
	}
	var (
		mu        sync.Mutex
		events    []decoder.TraceEvent
		first     = map[int]bool{} // forwards the first stage has started
		lastEnd   = map[int]bool{} // forwards the second stage has finished
		crossings int
	)
	lastMicro := map[int]int{}
	for i, bt := range batches {
		lastMicro[i] = len(p.Cut(bt)) - 1
	}
	p.Trace = func(e decoder.TraceEvent) {
		mu.Lock()
		defer mu.Unlock()
		events = append(events, e)
		if e.Stage == 1 && e.End && e.Micro == lastMicro[e.Forward%pipeBatches] {
			lastEnd[e.Forward] = true
		}
		if e.Stage == 0 && !e.End && e.Micro == 0 {
			if first[e.Forward-1] && !lastEnd[e.Forward-1] {
				crossings++
			}
			first[e.Forward] = true
		}
	}
	for _, c := range []string{"one_stage_batches", "two_stages_batches_drained", "two_stages_back_to_back"} {
		b.Run(c, func(b *testing.B) {
			run := func() {
				switch c {
				case "one_stage_batches":
					for _, bt := range batches {
						single.TopK(bt, 64, 1)
					}
				case "two_stages_batches_drained":
					for _, bt := range batches {
						p.TopK(bt, 64, 1)
					}
				default:
					var waits []func() ([]int32, []float32)
					for i, bt := range batches {
						waits = append(waits, p.StartTopK(bt, 64, 1))
						if i >= 1 { // two in flight
							waits[i-1]()
						}
					}
					waits[len(waits)-1]()
				}
			}
			run() // warm up
			// Exactness: each batch as the one stage's of its micro-batches.
			if c == "two_stages_back_to_back" {
				var waits []func() ([]int32, []float32)
				for _, bt := range batches {
					waits = append(waits, p.StartTopK(bt, 64, 1))
				}
				ok := true
				for i, w := range waits {
					ids, lps := w()
					var wIDs []int32
					var wLPs []float32
					for _, r := range p.Cut(batches[i]) {
						a, l := single.TopK(batches[i][r[0]:r[1]], 64, 1)
						wIDs, wLPs = append(wIDs, a...), append(wLPs, l...)
					}
					ok = ok && slices.Equal(ids, wIDs) && slices.Equal(lps, wLPs)
				}
				exact[c] = ok
				if !ok {
					b.Errorf("%s: a forward differs from the one stage's of the same micro-batches", c)
				}
			}
			a0.wait()
			a1.wait()
			mu.Lock()
			events, crossings, first, lastEnd = nil, 0, map[int]bool{}, map[int]bool{}
			mu.Unlock()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				run()
			}
			a0.wait()
			a1.wait()
			b.StopTimer()
			sec := b.Elapsed().Seconds() / float64(b.N)
			secs[c] = sec
			b.ReportMetric(float64(pipeBatches*n)/sec, "tokens/s")
			if base := secs["one_stage_batches"]; base > 0 && c != "one_stage_batches" {
				b.ReportMetric(100*(sec-base)/base, "overhead_%")
			}
			if c != "one_stage_batches" {
				mu.Lock()
				b.ReportMetric(float64(crossings)/float64(b.N), "cross_batch_starts")
				if !onGPU() && b.N == 1 {
					b.Logf("%s: schedule (stage:forward.micro, > start, < end): %s", c, schedule(events))
				}
				mu.Unlock()
			}
		})
	}
	if dir := os.Getenv("DISTILL_BENCH_OUT"); dir != "" && secs["one_stage"] > 0 {
		line, _ := json.Marshal(map[string]any{"bench": "pipeline-one-gpu", "shape": shape.Name, "device": a0.Info().Name, "tokens": n,
			"samples": len(samples), "split_at_layer": split[0].EndLayer, "seconds": secs, "exact": exact, "batches": pipeBatches})
		f, err := os.OpenFile(filepath.Join(dir, "pipeline-bench.jsonl"), os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
		if err == nil {
			fmt.Fprintf(f, "%s\n", line)
			f.Close()
		}
	}
	freeBenchModel(a0, whole)
	freeBenchModel(a0, s0)
	freeBenchModel(a1, s1)
}
