package decoder

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"distill/compute"
	"distill/compute/device"
	"distill/model"
)

// stages builds cfg's decoder (the weights of build's seed) as pipeline
// stages split at cuts (layer indices), each stage on a backend of its own.
func stages(t *testing.T, cfg *model.Config, cuts []int, newBackend func() compute.Backend) []*Model {
	t.Helper()
	w := model.Init(cfg, model.InitOptions{Seed: 5, Std: 0.2, Perturb: true})
	bounds := append(append([]int{0}, cuts...), cfg.Layers)
	var out []*Model
	for i := 0; i+1 < len(bounds); i++ {
		be := newBackend()
		asked := map[string]bool{}
		m, err := NewStage(cfg, be, func(name string) (compute.Tensor, compute.Tensor, error) {
			if asked[name] {
				return nil, nil, fmt.Errorf("%s asked twice", name)
			}
			asked[name] = true
			v, ok := w[name]
			if !ok {
				return nil, nil, fmt.Errorf("no %s", name)
			}
			return be.FromF32(v), nil, nil
		}, bounds[i], bounds[i+1])
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, m)
	}
	return out
}

// pipelineSamples are ragged samples of cfg's vocabulary.
func pipelineSamples(cfg *model.Config) [][]int32 {
	var s [][]int32
	for i, n := range []int{9, 1, 17, 4, 30, 2, 11} {
		row := make([]int32, n)
		for j := range row {
			row[j] = int32((i*37 + j*11) % cfg.VocabSize)
		}
		s = append(s, row)
	}
	return s
}

// TestPipelineMatchesWhole: a decoder split into 2 or 3 stages on
// backends of their own gives the whole model's top-k on one backend bit
// for bit: in one micro-batch, the whole batch's; cut into micro-batches,
// each micro-batch's (the cut, not the placement, is what may change
// bits). Every architecture, tied and untied heads, temperature 1 and
// not.
func TestPipelineMatchesWhole(t *testing.T) {
	for _, arch := range []model.Arch{model.ArchLlama, model.ArchQwen2, model.ArchQwen3, model.ArchQwen3MoE} {
		for _, tie := range []bool{false, true} {
			cfg := tinyConfig(arch)
			cfg.TieEmbeddings = tie
			cfg.Layers = 3
			whole := stages(t, cfg, nil, func() compute.Backend { return device.CPU(1) })[0]
			samples := pipelineSamples(cfg)
			const k = 6
			for _, cuts := range [][]int{{1}, {2}, {1, 2}} {
				for _, temp := range []float32{1, 0.7} {
					name := fmt.Sprintf("%s/tied=%v/cuts=%v/T=%v", arch, tie, cuts, temp)
					p, err := NewPipeline(stages(t, cfg, cuts, func() compute.Backend { return device.CPU(1) }))
					if err != nil {
						t.Fatal(err)
					}
					p.MicroBatches = 1
					wantIDs, wantLPs := whole.TopK(samples, k, temp)
					ids, lps := p.TopK(samples, k, temp)
					if !slices.Equal(ids, wantIDs) || !slices.Equal(lps, wantLPs) {
						t.Errorf("%s: one micro-batch: the pipeline's top-k differs from the whole model's", name)
					}
					p.MicroBatches, p.MinMicroTokens = 3, 1
					runs := p.Cut(samples)
					if len(runs) != 3 {
						t.Fatalf("%s: %d micro-batches, want 3: %v", name, len(runs), runs)
					}
					wantIDs, wantLPs = nil, nil
					for _, r := range runs {
						i, l := whole.TopK(samples[r[0]:r[1]], k, temp)
						wantIDs, wantLPs = append(wantIDs, i...), append(wantLPs, l...)
					}
					ids, lps = p.TopK(samples, k, temp)
					if !slices.Equal(ids, wantIDs) || !slices.Equal(lps, wantLPs) {
						t.Errorf("%s: micro-batches %v: the pipeline's top-k differs from the whole model's of each micro-batch", name, runs)
					}
				}
			}
		}
	}
}

// TestMicroBatches: the cut keeps the samples in order and whole, makes
// MicroBatches runs (default: four a stage; none on one stage) where the
// samples and MinMicroTokens allow, each but the last of at least
// MinMicroTokens tokens, and balances them: no run but the last exceeds
// the average by more than its last sample.
func TestMicroBatches(t *testing.T) {
	samples := make([][]int32, 40)
	total := 0
	for i := range samples {
		samples[i] = make([]int32, 1+(i*7)%50)
		total += len(samples[i])
	}
	for _, c := range []struct{ stages, mb, minTok, want int }{
		{2, 0, 1, 8}, {1, 0, 1, 1}, {3, 5, 1, 5}, {2, 8, 400, total / 400}, {2, 100, 1, 40}, {2, 3, 1 << 20, 1},
	} {
		p := &Pipeline{Stages: make([]*Model, c.stages), MicroBatches: c.mb, MinMicroTokens: c.minTok}
		runs := p.Cut(samples)
		if len(runs) != c.want || runs[0][0] != 0 || runs[len(runs)-1][1] != len(samples) {
			t.Errorf("%+v: runs %v, want %d covering all", c, runs, c.want)
		}
		for i, r := range runs {
			n := 0
			for _, s := range samples[r[0]:r[1]] {
				n += len(s)
			}
			lastLen := len(samples[r[1]-1])
			if r[1] <= r[0] || (i > 0 && r[0] != runs[i-1][1]) || (i+1 < len(runs) && (n < c.minTok || n > total/len(runs)+lastLen+c.minTok)) {
				t.Errorf("%+v: run %d %v of %d tokens (%d runs of %d tokens)", c, i, r, n, len(runs), total)
			}
		}
	}
	p := &Pipeline{Stages: make([]*Model, 2), MicroBatches: 3, MinMicroTokens: 1}
	if runs := p.Cut([][]int32{make([]int32, 1), make([]int32, 7), make([]int32, 33), make([]int32, 130)}); !slices.Equal(runs, [][2]int{{0, 2}, {2, 3}, {3, 4}}) {
		t.Errorf("the goldens' samples: %v", runs)
	}
}

// failing is a CPU backend whose Attention panics on call n.
type failing struct {
	compute.Backend
	n     int
	calls int
}

func (f *failing) Attention(out, lse, q, k, v, starts compute.Tensor, nSeq, maxLen, n, heads, kvHeads, hd int, scale float32) {
	if f.calls++; f.calls == f.n {
		panic(fmt.Errorf("%w: the test's failure", compute.ErrOutOfMemory))
	}
	f.Backend.Attention(out, lse, q, k, v, starts, nSeq, maxLen, n, heads, kvHeads, hd, scale)
}

// TestPipelineFailure: a stage's panic mid-pipeline stops the others and
// is raised on the caller's goroutine, naming the stage and its device
// and wrapping the backend's error; the pipeline runs again after it.
func TestPipelineFailure(t *testing.T) {
	cfg := tinyConfig(model.ArchQwen3)
	cfg.Layers = 4
	var fb *failing
	i := 0
	st := stages(t, cfg, []int{1, 3}, func() compute.Backend {
		i++
		if i == 2 {
			fb = &failing{Backend: device.CPU(1), n: 5}
			return fb
		}
		return device.CPU(1)
	})
	p, err := NewPipeline(st)
	if err != nil {
		t.Fatal(err)
	}
	p.MicroBatches, p.MinMicroTokens = 4, 1
	samples := pipelineSamples(cfg)
	func() {
		defer func() {
			r := recover()
			err, ok := r.(error)
			if !ok || !strings.Contains(err.Error(), "pipeline stage 1 (layers 1-2) on cpu") || !strings.Contains(err.Error(), "the test's failure") {
				t.Errorf("panic %v, want an error naming stage 1", r)
			}
		}()
		p.TopK(samples, 3, 1)
	}()
	fb.n = -1
	p.MicroBatches = 1
	ids, lps := p.TopK(samples, 3, 1)
	wantIDs, wantLPs := stages(t, cfg, nil, func() compute.Backend { return device.CPU(1) })[0].TopK(samples, 3, 1)
	if !slices.Equal(ids, wantIDs) || !slices.Equal(lps, wantLPs) {
		t.Errorf("after the failure: the pipeline's top-k differs from the whole model's")
	}
}

// TestPipelineBackToBack: forwards started back to back flow through the
// stages one after the other: the first stage takes forward 1's first
// micro-batch while the last stage still holds forward 0's last one (the
// last stage is held there, in its trace, until the first has started
// forward 1: without the overlap that never happens). Each forward's
// top-k is the whole model's of each of its micro-batches, bit for bit,
// and every stage runs the forwards, and their micro-batches, in order.
func TestPipelineBackToBack(t *testing.T) {
	cfg := tinyConfig(model.ArchQwen3)
	cfg.Layers = 3
	whole := stages(t, cfg, nil, func() compute.Backend { return device.CPU(1) })[0]
	for _, cuts := range [][]int{{1}, {1, 2}} {
		p, err := NewPipeline(stages(t, cfg, cuts, func() compute.Backend { return device.CPU(1) }))
		if err != nil {
			t.Fatal(err)
		}
		p.MicroBatches, p.MinMicroTokens = 3, 1
		S := len(p.Stages)
		base := pipelineSamples(cfg)
		batches := [][][]int32{base, base[2:], base[:4], base[1:6]}
		temps := []float32{1, 0.7, 1, 1.3}
		started := make(chan struct{}) // stage 0 has started forward 1
		var mu sync.Mutex
		order := make([][]TraceEvent, S)
		p.Trace = func(e TraceEvent) {
			if e.Stage == 0 && e.Forward == 1 && e.Micro == 0 && !e.End {
				close(started)
			}
			if e.Stage == S-1 && e.Forward == 0 && e.Micro == len(p.Cut(batches[0]))-1 && !e.End {
				select {
				case <-started:
				case <-time.After(time.Minute):
					t.Errorf("cuts %v: the first stage did not start forward 1 while the last held forward 0's last micro-batch", cuts)
				}
			}
			mu.Lock()
			order[e.Stage] = append(order[e.Stage], e)
			mu.Unlock()
		}
		var waits []func() ([]int32, []float32)
		for i, b := range batches {
			waits = append(waits, p.StartTopK(b, 5, temps[i]))
		}
		for i, w := range waits {
			ids, lps := w()
			var wantIDs []int32
			var wantLPs []float32
			for _, r := range p.Cut(batches[i]) {
				a, b := whole.TopK(batches[i][r[0]:r[1]], 5, temps[i])
				wantIDs, wantLPs = append(wantIDs, a...), append(wantLPs, b...)
			}
			if !slices.Equal(ids, wantIDs) || !slices.Equal(lps, wantLPs) {
				t.Errorf("cuts %v: forward %d: the top-k differs from the whole model's of its micro-batches", cuts, i)
			}
		}
		for s, evs := range order {
			var want []TraceEvent
			for f, b := range batches {
				for j := range p.Cut(b) {
					want = append(want, TraceEvent{Stage: s, Forward: f, Micro: j}, TraceEvent{Stage: s, Forward: f, Micro: j, End: true})
				}
			}
			got := make([]TraceEvent, len(evs))
			for i, e := range evs {
				got[i] = TraceEvent{Stage: e.Stage, Forward: e.Forward, Micro: e.Micro, End: e.End}
			}
			if !slices.Equal(got, want) {
				t.Errorf("cuts %v: stage %d ran %v, want the forwards and their micro-batches in order", cuts, s, got)
			}
		}
	}
}

// counting is a CPU backend that counts its live tensors and, when armed,
// panics with an out-of-memory error on its failAt-th allocation.
type counting struct {
	compute.Backend
	mu     sync.Mutex
	live   map[compute.Tensor]bool
	allocs int
	failAt int // 0: never
}

func newCounting() *counting {
	return &counting{Backend: device.CPU(1), live: map[compute.Tensor]bool{}}
}

func (c *counting) made(t compute.Tensor) compute.Tensor {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.live[t] = true
	return t
}

func (c *counting) alloc() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.allocs++; c.allocs == c.failAt {
		panic(fmt.Errorf("%w: the test's allocation %d", compute.ErrOutOfMemory, c.allocs))
	}
}

func (c *counting) New(dt compute.DType, n int) compute.Tensor {
	c.alloc()
	return c.made(c.Backend.New(dt, n))
}
func (c *counting) FromF32(v []float32) compute.Tensor {
	c.alloc()
	return c.made(c.Backend.FromF32(v))
}
func (c *counting) FromI32(v []int32) compute.Tensor { c.alloc(); return c.made(c.Backend.FromI32(v)) }
func (c *counting) Free(t compute.Tensor) {
	c.mu.Lock()
	delete(c.live, t)
	c.mu.Unlock()
	c.Backend.Free(t)
}
func (c *counting) liveCount() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.live)
}

// TestPipelineFailureFrees: a stage that fails at any allocation of a
// forward (its batch upload, its activations, the temperature's norm
// weight, the LM head's outputs) or in a kernel frees what it allocated,
// and the other stages free what they held: every stage's live tensors
// come back to their count before. The error names the stage and its
// device, and wraps the backend's. The forwards started before and after
// the failing one are served as usual.
func TestPipelineFailureFrees(t *testing.T) {
	cfg := tinyConfig(model.ArchQwen3)
	cfg.Layers = 3
	whole := stages(t, cfg, nil, func() compute.Backend { return device.CPU(1) })[0]
	var cbs []*counting
	p, err := NewPipeline(stages(t, cfg, []int{1, 2}, func() compute.Backend {
		c := newCounting()
		cbs = append(cbs, c)
		return c
	}))
	if err != nil {
		t.Fatal(err)
	}
	p.MicroBatches, p.MinMicroTokens = 3, 1
	samples := pipelineSamples(cfg)
	// A first forward leaves each stage its RoPE table, kept between
	// forwards (ropeRows): the counts are taken after it.
	p.TopK(samples, 4, 0.5)
	before := make([]int, len(cbs))
	for i, c := range cbs {
		before[i] = c.liveCount()
	}
	// The allocations of one forward, stage by stage.
	per := make([]int, len(cbs))
	for i, c := range cbs {
		per[i] = c.allocs
	}
	p.TopK(samples, 4, 0.5)
	for i, c := range cbs {
		per[i] = c.allocs - per[i]
	}
	checkOK := func(what string, ids []int32, lps []float32, smp [][]int32, temp float32) {
		var wantIDs []int32
		var wantLPs []float32
		for _, r := range p.Cut(smp) {
			a, b := whole.TopK(smp[r[0]:r[1]], 4, temp)
			wantIDs, wantLPs = append(wantIDs, a...), append(wantLPs, b...)
		}
		if !slices.Equal(ids, wantIDs) || !slices.Equal(lps, wantLPs) {
			t.Errorf("%s: the top-k differs from the whole model's", what)
		}
	}
	fails := 0
	for s, c := range cbs {
		for k := 1; k <= per[s]; k++ {
			what := fmt.Sprintf("stage %d, allocation %d of %d", s, k, per[s])
			// The forward before takes its allocations first: arm the
			// failure once it is done, so it hits the next forward's.
			ids, lps := p.StartTopK(samples[:3], 4, 1)()
			checkOK(what+": the forward before", ids, lps, samples[:3], 1)
			c.failAt = c.allocs + k
			fw := p.StartTopK(samples, 4, 0.5)
			next := p.StartTopK(samples[2:], 4, 1)
			func() {
				defer func() {
					r := recover()
					err, ok := r.(error)
					if !ok || !errors.Is(err, compute.ErrOutOfMemory) || !strings.Contains(err.Error(), fmt.Sprintf("pipeline stage %d (layers %d-%d) on cpu", s, s, s)) {
						t.Errorf("%s: panic %v, want an out-of-memory error naming stage %d", what, r, s)
					}
					fails++
				}()
				fw()
			}()
			c.mu.Lock() // the forward after may be allocating
			c.failAt = 0
			c.mu.Unlock()
			ids, lps = next()
			checkOK(what+": the forward after", ids, lps, samples[2:], 1)
			for i, cc := range cbs {
				if n := cc.liveCount(); n != before[i] {
					t.Errorf("%s: stage %d holds %d tensors, %d before", what, i, n, before[i])
				}
			}
		}
	}
	if fails == 0 {
		t.Fatal("no failure was tried")
	}
	// A kernel's failure (Attention) on the middle stage.
	fb := &failing{Backend: cbs[1], n: 2}
	p.Stages[1].be = fb
	func() {
		defer func() {
			if r := recover(); r == nil || !strings.Contains(fmt.Sprint(r), "pipeline stage 1 (layers 1-1) on cpu") {
				t.Errorf("a failing kernel: panic %v", r)
			}
		}()
		p.TopK(samples, 4, 1)
	}()
	for i, cc := range cbs {
		if n := cc.liveCount(); n != before[i] {
			t.Errorf("a failing kernel: stage %d holds %d tensors, %d before", i, n, before[i])
		}
	}
}
