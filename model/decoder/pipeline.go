package decoder

import (
	"fmt"
	"reflect"
	"sync"
	"time"

	"distill/compute"
)

// Pipeline is the teacher's forward over a decoder split into stages,
// each on a backend of its own (one GPU each, or several stages sharing
// one: streams of their own), run as a pipeline of micro-batches: a
// packed batch is cut, at sample boundaries, into micro-batches that
// enter the first stage one after the other; each stage runs a
// micro-batch through its layers and hands it on (the residual stream
// and the next layer's normed input, copied to the next stage's device:
// compute.CopyAcrossAfter, peer to peer where the driver allows it,
// ordered on the devices by the mark the stage set when it issued the
// hand-off, so no host waits for a stage), then takes the next, so that
// once the pipeline has filled every stage works on a micro-batch at
// once. The last stage runs the LM head of each micro-batch, in order.
//
// Forwards flow through it back to back: Start issues a forward and
// returns at once, and the forwards started are served in the order they
// were started, each stage taking forward n+1's first micro-batch as soon
// as it is done with forward n's last. So the pipeline fills and drains
// once for a run of batches, not once per batch, as long as the caller
// keeps forwards started (serve's batcher keeps one a stage in flight).
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
// on the next micro-batch. Forwards in flight do not add to it: a stage
// works on one forward at a time, and starts the next only once its last
// hand-off of the one before has been taken; the last stage's
// temperature-scaled norm weight is made and freed within its turn.
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
	// Trace, when set, is called as a stage starts and as it ends its
	// work on a micro-batch (on the stage's goroutine: calls of different
	// stages may come at once): the schedule, for tests and benchmarks.
	Trace func(TraceEvent)

	mu   sync.Mutex
	seq  int             // forwards started
	tail []chan struct{} // per stage, closed when the last forward started is done with it
}

// TraceEvent is a stage starting (or, End, ending) micro-batch Micro of
// the forward Forward (numbered from 0 in the order they were started).
type TraceEvent struct {
	Stage, Forward, Micro int
	End                   bool
	At                    time.Time
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
	p.Forward(samples, temperature, p.topKHead(samples, k, &ids, &logprobs))
	return ids, logprobs
}

// StartTopK is TopK started (Start): wait returns its result.
func (p *Pipeline) StartTopK(samples [][]int32, k int, temperature float32) (wait func() (ids []int32, logprobs []float32)) {
	var ids []int32
	var logprobs []float32
	fl := p.Start(samples, temperature, p.topKHead(samples, k, &ids, &logprobs))
	return func() ([]int32, []float32) {
		fl.Wait()
		return ids, logprobs
	}
}

// topKHead is the head of TopK, writing its result to *ids and *logprobs.
func (p *Pipeline) topKHead(samples [][]int32, k int, ids *[]int32, logprobs *[]float32) Head {
	n := 0
	for _, s := range samples {
		n += len(s)
	}
	return func(last *Model, x compute.Tensor, _, t0 int, mb [][]int32) {
		m := 0
		for _, s := range mb {
			m += len(s)
		}
		i, l := last.lmHeadTopK(x, m, k)
		if m == n { // one micro-batch: its result is the forward's
			*ids, *logprobs = i, l
			return
		}
		if *ids == nil {
			*ids, *logprobs = make([]int32, n*k), make([]float32, n*k)
		}
		copy((*ids)[t0*k:], i)
		copy((*logprobs)[t0*k:], l)
	}
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
// temperature, calling head on the last stage for each micro-batch, and
// returns when it is done: Start(...).Wait(), or on one stage the forward
// run on the caller's goroutine.
func (p *Pipeline) Forward(samples [][]int32, temperature float32, head Head) {
	if len(p.Stages) == 1 {
		p.forwardOne(p.plan(samples), temperature, head)
		return
	}
	p.Start(samples, temperature, head).Wait()
}

// Flight is a forward started (Pipeline.Start).
type Flight struct {
	done    chan struct{}
	failure any    // a stage's panic
	who     string // the stage that raised it; "" on one stage
}

// Wait returns once the forward is done, or raises its failure again: a
// stage's panic (an out-of-memory error, a failed kernel) as an error
// naming the stage, its layers and its device, wrapping the backend's.
func (f *Flight) Wait() {
	<-f.done
	switch r := f.failure.(type) {
	case nil:
	case error:
		if f.who == "" {
			panic(r)
		}
		panic(fmt.Errorf("%s: %w", f.who, r))
	default:
		if f.who == "" {
			panic(r)
		}
		panic(fmt.Sprintf("%s: %v", f.who, r))
	}
}

// Start starts a forward of samples (valid: see TopK) at temperature,
// calling head on the last stage for each micro-batch, and returns at
// once (on one stage: once the forward has run, on the caller's
// goroutine). Forwards are served in the order they are started: each
// stage runs forward n's micro-batches, in order, before forward n+1's,
// and begins forward n+1 as soon as it is done with n, while the stages
// after it still work on n. head's calls of one forward come in
// micro-batch order, all before the next forward's. Start may be called
// from several goroutines; the caller bounds the forwards in flight (each
// holds its samples and results on the host, not on the devices). A
// stage's panic stops that forward's other stages, frees what they held,
// and is raised by Wait; the forwards before and after it go on.
func (p *Pipeline) Start(samples [][]int32, temperature float32, head Head) *Flight {
	pl := p.plan(samples)
	fl := &Flight{done: make(chan struct{})}
	if len(p.Stages) == 1 {
		func() {
			defer func() { fl.failure = recover() }()
			p.forwardOne(pl, temperature, head)
		}()
		close(fl.done)
		return fl
	}
	S := len(p.Stages)
	p.mu.Lock()
	n, prev := p.seq, p.tail
	p.seq++
	mine := make([]chan struct{}, S)
	for s := range mine {
		mine[s] = make(chan struct{})
	}
	p.tail = mine
	p.mu.Unlock()
	go func() {
		defer close(fl.done)
		p.run(fl, n, prev, mine, pl, temperature, head)
	}()
	return fl
}

// fwdPlan is a forward's cut: its micro-batches' samples [a, b) (runs),
// flat tokens, sample starts and first token.
type fwdPlan struct {
	samples      [][]int32
	runs         [][2]int
	flat, starts [][]int32
	t0           []int
}

func (p *Pipeline) plan(samples [][]int32) *fwdPlan {
	runs := p.Cut(samples)
	pl := &fwdPlan{samples: samples, runs: runs, flat: make([][]int32, len(runs)), starts: make([][]int32, len(runs)), t0: make([]int, len(runs))}
	tok := 0
	for j, r := range runs {
		m := 0
		for _, s := range samples[r[0]:r[1]] {
			m += len(s)
		}
		pl.flat[j], pl.starts[j] = make([]int32, 0, m), make([]int32, 1, r[1]-r[0]+1)
		pl.t0[j] = tok
		for _, s := range samples[r[0]:r[1]] {
			pl.flat[j] = append(pl.flat[j], s...)
			pl.starts[j] = append(pl.starts[j], int32(len(pl.flat[j])))
		}
		tok += len(pl.flat[j])
	}
	return pl
}

// runStage runs micro-batch j of pl through stage s (in: its hand-off
// from stage s-1, nil on the first); on the last stage it runs head and
// frees the buffers, even on a panic of head.
func (p *Pipeline) runStage(pl *fwdPlan, s int, in *handoff, j int, normW compute.Tensor, head Head) *handoff {
	st := p.Stages[s]
	f, out := st.stageForward(pl.flat[j], pl.starts[j], in, normW)
	if f != nil {
		defer f.free(st.be)
		r := pl.runs[j]
		head(st, f.ln, r[0], pl.t0[j], pl.samples[r[0]:r[1]])
	}
	return out
}

// forwardOne runs a forward on the one stage, on the caller's goroutine.
func (p *Pipeline) forwardOne(pl *fwdPlan, temperature float32, head Head) {
	st := p.Stages[0]
	normW, made := st.finalNorm(temperature)
	if made {
		defer st.be.Free(normW)
	}
	for j := range pl.runs {
		p.runStage(pl, 0, nil, j, normW, head)
	}
}

// run runs forward n of pl through the stages, a goroutine each, and
// records in fl the first panic and the stage that raised it: stage s
// takes its turn once the forward before is done with it (prev[s], nil
// for the first forward), takes micro-batch j from stage s-1 (through an
// unbuffered channel: only when it is done with j-1), hands it to stage
// s+1, and gives its turn to the next forward (closes mine[s]) once it
// has handed on its last micro-batch, or has stopped. The first panic
// stops this forward's other stages; each frees what it allocated and
// the hand-off it held.
func (p *Pipeline) run(fl *Flight, n int, prev, mine []chan struct{}, pl *fwdPlan, temperature float32, head Head) {
	S, J := len(p.Stages), len(pl.runs)
	links := make([]chan *handoff, S-1)
	for i := range links {
		links[i] = make(chan *handoff)
	}
	done := make(chan struct{})
	var (
		once sync.Once
		wg   sync.WaitGroup
	)
	trace := func(s, j int, end bool) {
		if p.Trace != nil {
			p.Trace(TraceEvent{Stage: s, Forward: n, Micro: j, End: end, At: time.Now()})
		}
	}
	for s := 0; s < S; s++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { // the turn goes on, in order, whatever happened
				if prev != nil {
					<-prev[s]
				}
				close(mine[s])
			}()
			var held *handoff // received, maybe not yet copied and freed (Free is idempotent)
			defer func() {
				if r := recover(); r != nil {
					if held != nil {
						held.free()
					}
					once.Do(func() {
						fl.failure, fl.who = r, fmt.Sprintf("pipeline stage %d (layers %d-%d) on %s", s, p.Stages[s].first, p.Stages[s].end-1, compute.DeviceName(p.Stages[s].be))
						close(done)
					})
				}
			}()
			if prev != nil {
				select {
				case <-prev[s]:
				case <-done:
					return
				}
			}
			var normW compute.Tensor
			if s == S-1 { // within the turn: one forward's at a time
				w, made := p.Stages[s].finalNorm(temperature)
				if made {
					defer p.Stages[s].be.Free(w)
				}
				normW = w
			}
			for j := 0; j < J; j++ {
				var in *handoff
				if s > 0 {
					select {
					case in = <-links[s-1]:
					case <-done:
						return
					}
				}
				held = in
				trace(s, j, false)
				out := p.runStage(pl, s, in, j, normW, head)
				held = nil
				trace(s, j, true)
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
}
