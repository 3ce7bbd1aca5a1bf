// Package optim holds the student's optimizer: AdamW with decoupled weight
// decay exactly as torch.optim.AdamW (non-amsgrad), learning-rate schedules
// (constant, cosine, linear; linear warmup; floor at a minimum LR), and
// global-norm gradient clipping as torch.nn.utils.clip_grad_norm_.
// Master weights and both moments are fp32. The arithmetic runs on the
// parameters' backend (compute.Backend's AdamW, SumSquares and Scale).
package optim

import (
	"errors"
	"fmt"
	"math"

	"distill/compute"
)

// ErrInvalid is wrapped by every configuration error of this package.
var ErrInvalid = errors.New("optim: invalid configuration")

// Group is one parameter tensor (a view into the parameter arena) and its
// gradient, on Backend. Decay is false for norms and biases, which are not
// decayed (the usual LLM recipe: decay only matrices and embeddings).
type Group struct {
	Name  string
	Decay bool
	// Params and Grads are host views of P and G (a host backend), or nil.
	Params, Grads []float32
	Backend       compute.Backend
	P, G          compute.Tensor
	// BF16, when set, is a BF16 copy of P (P.Len() elements) that each
	// update keeps: it writes there the rounding to nearest even of every
	// updated element (compute.BF16Rounder's), in the same pass where the
	// backend can (compute.MultiTensor's AdamWEach). A sharded student's
	// groups at ZeRO 2 with BF16 gathers have one: their part of the
	// blocks' BF16 whole weights.
	BF16 compute.Tensor
}

// AdamWConfig are the hyper-parameters (torch names: betas, eps,
// weight_decay).
type AdamWConfig struct {
	Beta1, Beta2, Eps, WeightDecay float64
}

// Validate names the first bad hyper-parameter.
func (c AdamWConfig) Validate() error {
	if !(c.Beta1 >= 0 && c.Beta1 < 1) || !(c.Beta2 >= 0 && c.Beta2 < 1) {
		return fmt.Errorf("%w: adam betas (%g, %g): want each in [0, 1)", ErrInvalid, c.Beta1, c.Beta2)
	}
	if !(c.Eps > 0) {
		return fmt.Errorf("%w: adam eps %g: want > 0 (e.g. 1e-8)", ErrInvalid, c.Eps)
	}
	if !(c.WeightDecay >= 0) {
		return fmt.Errorf("%w: weight_decay %g: want >= 0", ErrInvalid, c.WeightDecay)
	}
	return nil
}

// AdamW keeps the moments m and v (fp32, one per parameter, on the
// groups' backend) and the step count that the bias corrections use.
type AdamW struct {
	Cfg    AdamWConfig
	Groups []Group
	// M and V are host views of the moments, per group (checkpoints write
	// and read them): they alias the backend's memory on a host backend
	// (compute.Host) and are nil otherwise.
	M, V  [][]float32
	Steps int // updates applied so far

	m, v []compute.Tensor
}

// NewAdamW returns an optimizer over groups with zeroed moments. Every
// group needs its backend tensors (P, G).
func NewAdamW(cfg AdamWConfig, groups []Group) (_ *AdamW, err error) {
	var a *AdamW
	defer func() {
		// A device backend's out-of-memory panic (its kernels return no
		// errors) is an error here; any other panic propagates.
		if r := recover(); r != nil {
			if e, ok := r.(error); ok && errors.Is(e, compute.ErrOutOfMemory) {
				err = fmt.Errorf("allocating the AdamW moments ran out of device memory: %w", e)
				if a != nil {
					a.Free() // what was allocated before
				}
				return
			}
			panic(r)
		}
	}()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	a = &AdamW{Cfg: cfg, Groups: groups}
	for _, g := range groups {
		if g.Backend == nil || g.P == nil || g.G == nil {
			return nil, fmt.Errorf("%w: group %s has no backend tensors", ErrInvalid, g.Name)
		}
		if g.P.Len() != g.G.Len() {
			return nil, fmt.Errorf("%w: group %s has %d params but %d grads", ErrInvalid, g.Name, g.P.Len(), g.G.Len())
		}
		if g.BF16 != nil {
			if _, ok := g.Backend.(compute.BF16Rounder); !ok || g.BF16.DType() != compute.BF16 || g.BF16.Len() < g.P.Len() {
				return nil, fmt.Errorf("%w: group %s has a BF16 copy of %d %v elements for %d params on the %s backend: want BF16, as many, on a backend that rounds to BF16",
					ErrInvalid, g.Name, g.BF16.Len(), g.BF16.DType(), g.P.Len(), g.Backend.Name())
			}
		}
		m, v := g.Backend.New(compute.F32, g.P.Len()), g.Backend.New(compute.F32, g.P.Len())
		a.m, a.v = append(a.m, m), append(a.v, v)
		if h, ok := g.Backend.(compute.Host); ok {
			a.M, a.V = append(a.M, h.HostF32(m)), append(a.V, h.HostF32(v))
		}
	}
	if len(a.M) != len(groups) {
		a.M, a.V = nil, nil
	}
	return a, nil
}

// Free releases the moments' backend memory; the optimizer is unusable
// after.
func (a *AdamW) Free() {
	for i := range a.m {
		a.Groups[i].Backend.Free(a.m[i])
		a.Groups[i].Backend.Free(a.v[i])
	}
	a.m, a.v, a.M, a.V = nil, nil, nil, nil
}

// Moments returns group i's moments on the host: the views M[i], V[i] on
// a host backend, copies downloaded from the device otherwise
// (checkpoints).
func (a *AdamW) Moments(i int) (m, v []float32) {
	if a.M != nil {
		return a.M[i], a.V[i]
	}
	g := a.Groups[i]
	m, v = make([]float32, g.P.Len()), make([]float32, g.P.Len())
	g.Backend.ReadF32(a.m[i], m)
	g.Backend.ReadF32(a.v[i], v)
	return m, v
}

// MomentTensors returns group i's moments on the backend (ZeRO-1's
// gather reads them there).
func (a *AdamW) MomentTensors(i int) (m, v compute.Tensor) { return a.m[i], a.v[i] }

// SetMoments sets group i's moments from host data of the group's length
// (a resumed checkpoint), on any backend.
func (a *AdamW) SetMoments(i int, m, v []float32) error {
	g := a.Groups[i]
	if len(m) != g.P.Len() || len(v) != g.P.Len() {
		return fmt.Errorf("%w: moments of group %s have %d and %d values, want %d", ErrInvalid, g.Name, len(m), len(v), g.P.Len())
	}
	g.Backend.WriteF32(a.m[i], m)
	g.Backend.WriteF32(a.v[i], v)
	return nil
}

// Step applies one update at learning rate lr, as torch.optim.AdamW:
//
//	p ← p·(1 - lr·wd)                      (decoupled decay, Decay groups only)
//	m ← β1·m + (1-β1)·g ;  v ← β2·v + (1-β2)·g²
//	p ← p - lr/(1-β1ᵗ) · m / (sqrt(v)/sqrt(1-β2ᵗ) + eps)
func (a *AdamW) Step(lr float64) {
	a.Steps++
	t := float64(a.Steps)
	st := compute.AdamWStep{Beta1: float32(a.Cfg.Beta1), Beta2: float32(a.Cfg.Beta2), Eps: float32(a.Cfg.Eps),
		StepSize: float32(lr / (1 - math.Pow(a.Cfg.Beta1, t))), BC2Sqrt: float32(math.Sqrt(1 - math.Pow(a.Cfg.Beta2, t)))}
	decay := float32(1 - lr*a.Cfg.WeightDecay)
	if mt, ok := a.multi(); ok {
		// One launch for every group (the groups share the backend).
		n := len(a.Groups)
		ps, gs, ns, decays := make([]compute.Tensor, n), make([]compute.Tensor, n), make([]int, n), make([]bool, n)
		var bs []compute.Tensor
		for gi, g := range a.Groups {
			ps[gi], gs[gi], ns[gi], decays[gi] = g.P, g.G, g.P.Len(), g.Decay
			if g.BF16 != nil {
				if bs == nil {
					bs = make([]compute.Tensor, n)
				}
				bs[gi] = g.BF16
			}
		}
		st.Decay = decay
		mt.AdamWEach(ps, gs, a.m, a.v, bs, ns, decays, st)
		return
	}
	for gi, g := range a.Groups {
		st.Decay = 1
		if g.Decay {
			st.Decay = decay
		}
		g.Backend.AdamW(g.P, g.G, a.m[gi], a.v[gi], g.P.Len(), st)
		if g.BF16 != nil {
			g.Backend.(compute.BF16Rounder).RoundBF16(g.BF16, g.P, g.P.Len())
		}
	}
}

// multi returns the groups' backend as a compute.MultiTensor when they
// share one that is.
func (a *AdamW) multi() (compute.MultiTensor, bool) {
	return multiOf(a.Groups)
}

// multiOf returns the groups' backend as a compute.MultiTensor when they
// all share one that is.
func multiOf(groups []Group) (compute.MultiTensor, bool) {
	if len(groups) == 0 {
		return nil, false
	}
	be := groups[0].Backend
	for _, g := range groups[1:] {
		if g.Backend != be {
			return nil, false
		}
	}
	mt, ok := be.(compute.MultiTensor)
	return mt, ok
}

// ClipGradNorm scales every gradient by maxNorm/(norm+1e-6) when the global
// L2 norm over all groups exceeds maxNorm (torch.nn.utils.clip_grad_norm_),
// and returns the norm before clipping. maxNorm <= 0 only measures. A
// non-finite norm is returned as is and nothing is scaled: the caller
// should skip the step and say which loss produced it.
func ClipGradNorm(groups []Group, maxNorm float64) float64 {
	return ClipGradNormSum(groups, maxNorm, nil)
}

// ClipGradNormSum is ClipGradNorm over groups that hold a part of the
// gradients each (ZeRO stages 2 and 3: a rank's pieces): sum adds up the
// parts' sums of squares over the ranks (an all-reduce), so that every
// rank clips by the same global norm. nil: groups hold them all.
func ClipGradNormSum(groups []Group, maxNorm float64, sum func(float64) float64) float64 {
	var ss float64
	for _, x := range sumSquares(groups) {
		ss += x
	}
	if sum != nil {
		ss = sum(ss)
	}
	norm := math.Sqrt(ss)
	if maxNorm <= 0 || math.IsNaN(norm) || math.IsInf(norm, 0) {
		return norm
	}
	coef := maxNorm / (norm + 1e-6)
	if coef >= 1 {
		return norm
	}
	if mt, ok := multiOf(groups); ok {
		xs, ns := make([]compute.Tensor, len(groups)), make([]int, len(groups))
		for i, g := range groups {
			xs[i], ns[i] = g.G, g.G.Len()
		}
		mt.ScaleEach(xs, ns, float32(coef))
		return norm
	}
	for _, g := range groups {
		g.Backend.Scale(g.G, g.G.Len(), float32(coef))
	}
	return norm
}

// sumSquares returns each group's Σ g², in the groups' order. Groups on a
// backend with compute.BatchSumSquares are summed in one call (one
// synchronization for all of them, not one per tensor); the values are
// SumSquares' either way, so the norm keeps its bits.
func sumSquares(groups []Group) []float64 {
	out := make([]float64, len(groups))
	type batch struct {
		at []int
		xs []compute.Tensor
		ns []int
	}
	var order []compute.Backend
	batches := map[compute.Backend]*batch{}
	for i, g := range groups {
		if _, ok := g.Backend.(compute.BatchSumSquares); !ok {
			out[i] = g.Backend.SumSquares(g.G, g.G.Len())
			continue
		}
		bt := batches[g.Backend]
		if bt == nil {
			bt = &batch{}
			batches[g.Backend] = bt
			order = append(order, g.Backend)
		}
		bt.at, bt.xs, bt.ns = append(bt.at, i), append(bt.xs, g.G), append(bt.ns, g.G.Len())
	}
	for _, be := range order {
		bt := batches[be]
		vals := make([]float64, len(bt.xs))
		be.(compute.BatchSumSquares).SumSquaresEach(vals, bt.xs, bt.ns)
		for j, i := range bt.at {
			out[i] = vals[j]
		}
	}
	return out
}

// ScheduleKind names an LR schedule (config key lr_schedule).
type ScheduleKind string

// LR schedules.
const (
	Constant ScheduleKind = "constant"
	Cosine   ScheduleKind = "cosine"
	Linear   ScheduleKind = "linear"
)

// Schedule maps the 1-based update number to a learning rate: a linear
// warmup from Peak/Warmup to Peak over the first Warmup updates (so the
// first update already moves, unlike a warmup that starts at 0), then
// constant, or a cosine or linear decay from Peak to Min reached at update
// Total, and Min after that.
type Schedule struct {
	Kind          ScheduleKind
	Peak, Min     float64
	Warmup, Total int
}

// Validate names the first bad field.
func (s Schedule) Validate() error {
	switch s.Kind {
	case Constant, Cosine, Linear:
	default:
		return fmt.Errorf("%w: lr_schedule %q: want constant, cosine or linear", ErrInvalid, s.Kind)
	}
	if !(s.Peak > 0) || !(s.Min >= 0) || s.Min > s.Peak {
		return fmt.Errorf("%w: lr %g, min_lr %g: want 0 <= min_lr <= lr and lr > 0", ErrInvalid, s.Peak, s.Min)
	}
	if s.Warmup < 0 {
		return fmt.Errorf("%w: warmup_steps %d: want >= 0", ErrInvalid, s.Warmup)
	}
	if s.Kind != Constant && s.Total <= s.Warmup {
		return fmt.Errorf("%w: %s schedule needs total steps (%d) > warmup_steps (%d)", ErrInvalid, s.Kind, s.Total, s.Warmup)
	}
	return nil
}

// LR is the learning rate of update number step (1-based).
func (s Schedule) LR(step int) float64 {
	if step <= s.Warmup {
		return s.Peak * float64(step) / float64(s.Warmup)
	}
	if s.Kind == Constant {
		return s.Peak
	}
	if step >= s.Total {
		return s.Min
	}
	prog := float64(step-s.Warmup) / float64(s.Total-s.Warmup)
	if s.Kind == Cosine {
		return s.Min + (s.Peak-s.Min)*0.5*(1+math.Cos(math.Pi*prog))
	}
	return s.Peak - (s.Peak-s.Min)*prog
}
