package decoder

import (
	"fmt"
	"reflect"
	"sync"

	"distill/compute"
)

// Pipeline is the teacher's forward over a decoder split into stages,
// each on a backend of its own (one GPU each, or several stages sharing
// one: streams of their own), run as a pipeline of micro-batches: a
// packed batch is cut, at sample boundaries, into micro-batches that
// enter the first stage one after the other; each stage runs a
// micro-batch through its layers and hands it on (the residual stream
// and the next layer's normed input, copied to the next stage's device:
// compute.CopyAcross, peer to peer where the driver allows it), then
// takes the next, so that once the pipeline has filled every stage works
// on a micro-batch at once. The last stage runs the LM head of each
// micro-batch, in order.
//
// Each stage runs the same kernels over the same rows as one backend
// holding the whole model would for that micro-batch, in the same order:
// the forward of a micro-batch is bit for bit the whole model's forward
// of it on one device. Only the cut into micro-batches can change bits
// (as packing does: a kernel's summation order may depend on the batch's
// size), so MicroBatches 1 is bit for bit TopK on one device.
//
// A stage's memory is its weights, one micro-batch's activations (a stage
// allocates them per micro-batch, as TopK does per batch), and, on every
// stage but the last, one hand-off: the next stage takes a micro-batch
// only when it is done with the previous one, copies it at once and frees
// it, so a stage holds at most the hand-off it is passing while it works
// on the next micro-batch.
type Pipeline struct {
	// Stages hold layers [0, a), [a, b), ..., [z, layers) in order
	// (NewStage), each on its backend; every stage's activation dtype is
	// the same.
	Stages []*Model
	// MicroBatches is the most micro-batches a forward is cut into (0:
	// four a stage; 1 with one stage: no cut), each of at least
	// MinMicroTokens tokens (0: DefaultMinMicroTokens) unless the batch
	// is smaller.
	MicroBatches, MinMicroTokens int
}

// DefaultMinMicroTokens is the fewest tokens a micro-batch is cut to
// (Pipeline.MinMicroTokens): smaller ones would leave a GPU's GEMMs short
// of rows.
const DefaultMinMicroTokens = 1024

// Head runs the LM head of one micro-batch on the last stage: x (n rows,
// the activation dtype, 1/temperature folded in) is the head's input on
// last's backend; the micro-batch holds samples [s0, s0+len(samples)) of
// the forward's, tokens [t0, t0+n). Heads run in micro-batch order, on
// one goroutine.
type Head func(last *Model, x compute.Tensor, s0, t0 int, samples [][]int32)

// NewPipeline checks that stages cover a decoder's layers in order with
// the embedding first and the head last, on backends of one activation
// dtype.
func NewPipeline(stages []*Model) (*Pipeline, error) {
	if len(stages) == 0 {
		return nil, fmt.Errorf("%w: a pipeline of no stages", ErrInvalid)
	}
	c := stages[0].Cfg
	for i, s := range stages {
		want := 0
		if i > 0 {
			want = stages[i-1].end
		}
		if s.first != want || !reflect.DeepEqual(s.Cfg, c) || (i+1 == len(stages)) != (s.end == c.Layers) {
			return nil, fmt.Errorf("%w: pipeline stage %d holds layers [%d, %d) of %d: want [%d, ...) of one model, the last ending at %d", ErrInvalid, i, s.first, s.end, c.Layers, want, c.Layers)
		}
		if a, b := s.be.ActDType(), stages[0].be.ActDType(); a != b {
			return nil, fmt.Errorf("%w: pipeline stage %d's activations are %v, stage 0's %v", ErrInvalid, i, a, b)
		}
	}
	return &Pipeline{Stages: stages}, nil
}

// TopK is Model.TopK through the pipeline.
func (p *Pipeline) TopK(samples [][]int32, k int, temperature float32) (ids []int32, logprobs []float32) {
	n := 0
	for _, s := range samples {
		n += len(s)
	}
	p.Forward(samples, temperature, func(last *Model, x compute.Tensor, _, t0 int, mb [][]int32) {
		m := 0
		for _, s := range mb {
			m += len(s)
		}
		i, l := last.lmHeadTopK(x, m, k)
		if m == n { // one micro-batch: its result is the forward's
			ids, logprobs = i, l
			return
		}
		if ids == nil {
			ids, logprobs = make([]int32, n*k), make([]float32, n*k)
		}
		copy(ids[t0*k:], i)
		copy(logprobs[t0*k:], l)
	})
	return ids, logprobs
}

// Cut cuts samples, in order, into runs [a, b) of samples: at most
// p.MicroBatches of them (fewer where there are fewer samples, or
// MinMicroTokens says so), balanced by tokens: each run takes the next
// sample while that brings it nearer the tokens left over the runs left,
// or while it is short of MinMicroTokens, and leaves a sample for each
// run after it.
func (p *Pipeline) Cut(samples [][]int32) [][2]int {
	mb := p.MicroBatches
	if mb <= 0 {
		mb = 4 * len(p.Stages)
		if len(p.Stages) == 1 {
			mb = 1
		}
	}
	minTok := p.MinMicroTokens
	if minTok <= 0 {
		minTok = DefaultMinMicroTokens
	}
	left := 0
	for _, s := range samples {
		left += len(s)
	}
	mb = max(1, min(mb, len(samples), left/minTok))
	var out [][2]int
	for a := 0; a < len(samples); {
		runsLeft := mb - len(out)
		b, n := a, 0
		if runsLeft == 1 {
			b, n = len(samples), left
		}
		target := float64(left) / float64(runsLeft)
		for b < len(samples) && len(samples)-b > runsLeft-1 {
			l := len(samples[b])
			if n > 0 && n >= minTok && float64(n)+float64(l)/2 > target {
				break
			}
			n += l
			b++
		}
		out = append(out, [2]int{a, b})
		left -= n
		a = b
	}
	return out
}

// Forward runs the pipeline over samples (valid: see TopK) at
// temperature, calling head on the last stage for each micro-batch. A
// panic of any stage's backend (an out-of-memory error, a failed kernel)
// stops every stage, frees what was in flight, and is raised again on the
// caller's goroutine.
func (p *Pipeline) Forward(samples [][]int32, temperature float32, head Head) {
	last := p.Stages[len(p.Stages)-1]
	normW, made := last.finalNorm(temperature)
	if made {
		defer last.be.Free(normW)
	}
	runs := p.Cut(samples)
	// One micro-batch's flat tokens and starts, and its first token.
	flat := make([][]int32, len(runs))
	starts := make([][]int32, len(runs))
	t0 := make([]int, len(runs))
	tok := 0
	for j, r := range runs {
		m := 0
		for _, s := range samples[r[0]:r[1]] {
			m += len(s)
		}
		flat[j], starts[j] = make([]int32, 0, m), make([]int32, 1, r[1]-r[0]+1)
		t0[j] = tok
		for _, s := range samples[r[0]:r[1]] {
			flat[j] = append(flat[j], s...)
			starts[j] = append(starts[j], int32(len(flat[j])))
		}
		tok += len(flat[j])
	}
	runStage := func(s int, in *handoff, j int) *handoff {
		st := p.Stages[s]
		f, out := st.stageForward(flat[j], starts[j], in, normW)
		if f != nil {
			head(st, f.ln, runs[j][0], t0[j], samples[runs[j][0]:runs[j][1]])
			f.freeTmp(st.be)
			st.be.Free(f.x)
			st.be.Free(f.ln)
		}
		return out
	}
	if len(p.Stages) == 1 { // on the caller's goroutine
		for j := range runs {
			runStage(0, nil, j)
		}
		return
	}
	p.run(len(runs), runStage)
}

// run runs stages as goroutines over micro-batches 0..n-1: stage s takes
// micro-batch j from stage s-1 (through an unbuffered channel: only when
// it is done with j-1) and hands it to stage s+1. The first panic stops
// the others (the hand-offs they hold are freed; a failed stage's own
// buffers are not, as a failed forward's on one backend are not) and is
// raised again here.
func (p *Pipeline) run(n int, runStage func(s int, in *handoff, j int) *handoff) {
	S := len(p.Stages)
	links := make([]chan *handoff, S-1)
	for i := range links {
		links[i] = make(chan *handoff)
	}
	done := make(chan struct{})
	var (
		once    sync.Once
		failure any
		who     string
		wg      sync.WaitGroup
	)
	for s := 0; s < S; s++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var held *handoff // received, maybe not yet copied and freed (Free is idempotent)
			defer func() {
				if r := recover(); r != nil {
					if held != nil {
						held.free()
					}
					once.Do(func() {
						failure, who = r, fmt.Sprintf("pipeline stage %d (layers %d-%d) on %s", s, p.Stages[s].first, p.Stages[s].end-1, compute.DeviceName(p.Stages[s].be))
						close(done)
					})
				}
			}()
			for j := 0; j < n; j++ {
				var in *handoff
				if s > 0 {
					select {
					case in = <-links[s-1]:
					case <-done:
						return
					}
				}
				held = in
				out := runStage(s, in, j)
				held = nil
				if s+1 < S {
					select {
					case links[s] <- out:
					case <-done:
						out.free()
						return
					}
				}
			}
		}()
	}
	wg.Wait()
	if failure != nil {
		if err, ok := failure.(error); ok {
			panic(fmt.Errorf("%s: %w", who, err))
		}
		panic(fmt.Sprintf("%s: %v", who, failure))
	}
}
