// Package loss computes the student's KD + SFT loss and its gradient with
// the LM head fused in: the backend's LossHeadForward produces the logits
// in vocabulary tiles (tokens x TileCols), reduced with an online
// log-sum-exp, and its LossHeadBackward recomputes them tile by tile, so
// [tokens x vocab] is never held (Qwen3's V = 151936 at 8k tokens would be
// 5 GB in fp32). This package validates the batch, picks the counted
// positions and computes, in float64 on the host, each one's divergence
// and the gradient coefficients (compute.LossCoef) from the statistics of
// pass 1 (compute.LossStats): the definitions below live here once, for
// every backend. A backend that computes the coefficients itself
// (compute.DeviceLossCoef: the CUDA backend) does so for the training
// steps it covers (deviceCovers: one teacher's top-k under fwd_kl, or CE
// only), bit for bit as this package does, so that its device need not
// wait for the host between the passes; exp and log are compute.Exp and
// compute.Log, whose bits a device can reproduce.
//
// # Definitions
//
// Position t of a packed batch predicts token t+1. It counts when t+1 is
// in the same sample and Mask[t+1] = 1 (the label is a training target);
// the teacher's top-k at t (ids K_t, log-probs lp normalized over the full
// vocabulary at the capture temperature) describe the distribution of t+1.
// With student logits z and temperature T, the student log-probs are first
// computed over the FULL vocabulary, lq = z/T - logsumexp_V(z/T); what a
// tail mode does with them is below.
//
// Tail modes (config key tail): how the mass outside K_t is treated. The
// teacher renormalized over K_t at the KD temperature is
// p̃ = softmax_K(lp·Tc/T), exact for a teacher tempered from capture
// temperature Tc to T, because lp differs from the teacher's logits/Tc by a
// constant.
//
//   - bucket (default, Megatron-LM's offline KD): a (k+1)-th bucket holds
//     the tail, 1 - Σ_K p for the teacher and 1 - Σ_K q for the student, so
//     both sides are proper distributions over k+1 outcomes, normalized over
//     the full vocabulary. The student's tail is accumulated directly as
//     Σ_{v∉K} exp(z_v/T - m) in float64 (the K entries are masked out of
//     each logits tile first), not as 1 - Σ_K q or Σ_V - Σ_K, so it keeps
//     its digits when the top-k holds all but a tiny part of the mass. The
//     teacher's tail at a temperature other than Tc is not known from a
//     top-k, so bucket requires T = Tc. Optimum: q_e = p_e on K and on the
//     tail (how the student spreads its tail inside it is free).
//   - renormalize (NeMo-Aligner's top-k KD): both sides are renormalized
//     over K_t, p̃ as above and q̃ = softmax_K(z_K/T), and the divergence is
//     between these two distributions over k outcomes. Every divergence is
//     proper on it; the optimum is q̃ = p̃. It does not see the student's
//     mass outside K_t at all (its gradient there is 0): sft_weight (the
//     cross-entropy on the labels) or tail bucket is what controls that
//     mass.
//   - zero (DistillKit's "missing mass is zero"): the teacher is p̃ on K_t
//     and 0 elsewhere; the student keeps its full-vocabulary lq. Defined for
//     fwd_kl only, where it is cross-entropy against p̃ (plus a constant):
//     Σ_K p̃ (log p̃ - lq), whose gradient +q_v on every v outside K_t pushes
//     that mass back into K_t; the optimum puts all of the student's mass on
//     K_t in p̃'s proportions. rev_kl against a teacher that is 0 outside
//     K_t is infinite whenever the student has mass there, so rev_kl and jsd
//     (which runs up to rev_kl at β = 1) with tail zero are a config error.
//     Before Definition 2 this mode was called renormalize.
//
// With k = V every mode is the exact full-vocabulary divergence.
//
// Sampled targets (Options.Targets sampled or head+sampled, the cache's
// targets): the teacher row is a sparse distribution r over its ids,
// given as log r in TopLP: r_v = count_v/N for ids drawn count_v times in
// N draws from the teacher (sampled), or the head's exact p_v and
// tail_mass·count_v/N on the ids drawn from outside it (head+sampled);
// rows may be padded with further distinct ids at r = 0 (log r = -Inf).
// E[r_v] = p_v for every id of the vocabulary, so against the student's
// full-vocabulary lq the
//
//	fwd_kl = Σ_v r_v (log r_v - lq_v),   ∂/∂s_v = q_v - r_v
//
// has the expected gradient of the exact full-vocabulary forward KL (and
// of the cross-entropy -Σ r log q, which differs by a constant): no tail
// mode applies, since r already carries the tail's mass. Its value is not
// unbiased (Σ r log r underestimates -H(p)); its gradient is. rev_kl and
// jsd are nonlinear in the teacher (they take log p where the student's
// mass is, and p is 0 wherever nothing was drawn), so on sampled targets
// they are biased, or infinite, and a config error; so is a temperature
// other than the capture temperature (tempering a sample is biased) and a
// tail other than the default bucket (the tail modes do not apply).
//
// Divergences over the entries e (K_t, plus the tail bucket under bucket),
// with p and q the two sides as the tail mode defines them (p̃ and q̃ under
// renormalize):
//
//   - fwd_kl = Σ p_e (log p_e - log q_e)
//   - rev_kl = Σ q_e (log q_e - log p_e)
//   - jsd    = β·KL(p‖m) + (1-β)·KL(q‖m), m = β·p + (1-β)·q: the
//     generalized JSD of GKD (Agarwal et al. 2023, Eq. 1) exactly as TRL's
//     GKDTrainer.generalized_jsd_loss computes it, including its endpoints:
//     β = 0 is fwd_kl and β = 1 is rev_kl (the formula itself would be 0
//     there; TRL special-cases them and so do we).
//
// Zero probabilities: a term p·log p with p = 0 is 0; logs of a tail bucket
// are floored at log(1e-30) so that a rounding-level tail (teacher top-k
// summing to 1 ± 1e-7) cannot produce an infinite loss.
//
// Total = KDWeight·(T² if ScaleT2)·KD + SFTWeight·CE, where CE is the
// cross-entropy of the untempered student (T = 1) on the label, and both
// are means over the counted positions (or divided by Options.Normalizer
// when gradient accumulation needs a global count).
//
// # Gradient
//
// Every divergence depends on the student only through lq_e, so with
// h_e = ∂L/∂lq_e and H = Σ_e h_e, the gradient on the tempered logits is
// ∂L/∂s_v = h_v·[v∈K] + h_tail·q_v/q_tail·[v∉K] - q_v·H (zero has no tail
// term). Under renormalize the divergence depends on lq̃_e = s_e - lse_K(s),
// so ∂L/∂s_v = (h_v - q̃_v·H)·[v∈K] and nothing outside K. The backward
// pass needs only h and H per position (and the K entries' coefficients),
// and q_v, recomputed in each tile from the saved log-sum-exp.
//
// # Multi-teacher KD
//
// With several teachers (Targets.Teachers: teacher t's top-k ids K^t at
// each position, k may differ, and a weight w_t >= 0; at least one
// weight > 0), KD = Σ_t w_t·D_t, where D_t is teacher t's divergence
// exactly as above under the configured tail mode, and Total is as above
// with this KD. The kernels are unchanged: pass 1 runs with, per counted
// position, the union U of the teachers' ids, padded to the batch's widest
// union with further distinct ids (the kernels take one K per call), so it
// returns z at every teacher's ids and the tail outside U. Teacher t's
// tail is that tail plus q_v over the columns of U outside its set,
// summed term by term (never 1 - Σ q), so it keeps its digits as the
// single-teacher tail does. The gradient is the weighted sum of the
// teachers' gradients above: explicit coefficients on the columns of U
// (a teacher's term on a column outside its set is its tail coefficient
// times q_v, or 0 under renormalize) and Σ_t w_t·(h_tail,t/q_tail,t - H_t)·q_v
// (bucket; -H_t under zero, 0 under renormalize) on every v outside U,
// the form LossHeadBackward takes. Stats.Teachers reports each D_t and
// each teacher's top-1 agreement: the student's argmax over U is its
// argmax over the vocabulary when its probability exceeds the mass
// outside U; the positions where that does not decide it run the LM
// head's streaming top-1 on their hidden states (one more LM-head
// forward at most, over those positions only). One teacher of weight 1,
// or two identical teachers at 0.5/0.5, give the single-teacher loss and
// gradient bit for bit. With KDWeight 0 the teachers are not read.
// Teachers may be of different target kinds (Teacher.Targets: a top-k
// teacher beside a sampled one): each D_t is its own kind's divergence
// above, the top-k teachers' under the tail mode, the sampled ones' the
// forward KL against r with the student's full softmax; when any teacher
// is sampled, the options must be what sampled targets take (fwd_kl, the
// capture temperature, tail bucket), as for one sampled teacher.
package loss

import (
	"errors"
	"fmt"
	"math"
	"runtime"
	"slices"
	"sync"

	"distill/compute"
	"distill/internal/errkind"
)

// ErrInvalid is wrapped by every error about bad options or bad targets.
var ErrInvalid = errors.New("loss: invalid input")

// Divergence selects the KD divergence (config key kd_loss).
type Divergence string

// KD divergences.
const (
	FwdKL Divergence = "fwd_kl"
	RevKL Divergence = "rev_kl"
	JSD   Divergence = "jsd"
)

// Tail selects how the teacher mass outside its top-k is handled (config
// key tail).
type Tail string

// Tail modes, see the package doc.
const (
	Bucket      Tail = "bucket"
	Renormalize Tail = "renormalize"
	Zero        Tail = "zero"
)

// Definition numbers the meaning of the (kd_loss, tail) objectives. It is
// recorded in training checkpoints so that a resume can tell when a tail
// name has changed meaning since the checkpoint was written. Bump it with
// any such change and say here what changed:
//
//   - 1 (checkpoints without a number): renormalize renormalized the
//     teacher only, with the student's full-vocabulary log-probs (what zero
//     is now; for rev_kl and jsd that was no proper divergence).
//   - 2: renormalize renormalizes both sides over K_t; zero is the old
//     fwd_kl renormalize; bucket is unchanged.
const Definition = 2

// TargetKind is what the teacher rows hold (config key distill.targets,
// which must match the cache's targets).
type TargetKind string

// Target kinds: a top-k, or the sparse distributions of the sampled kinds
// (see Sampled targets in the package doc).
const (
	TopK        TargetKind = "topk"
	Sampled     TargetKind = "sampled"
	HeadSampled TargetKind = "head+sampled"
)

// Options configure the loss. The zero value is not valid; see Validate.
type Options struct {
	// Targets is the kind of the teacher rows; "" is topk.
	Targets TargetKind
	KD      Divergence
	Beta    float64 // jsd interpolation in [0,1]: 0 = fwd_kl, 1 = rev_kl
	Tail    Tail
	// Temperature T divides the student logits for the KD term (CE always
	// uses T = 1). TeacherTemperature is the temperature the teacher's
	// log-probs were captured at (the cache manifest's); 0 means 1.
	Temperature, TeacherTemperature float64
	ScaleT2                         bool // multiply KD by T², as Hinton et al.
	KDWeight, SFTWeight             float64
}

// Validate reports the first bad option, naming the config key.
func (o *Options) Validate() error {
	switch o.KD {
	case FwdKL, RevKL, JSD:
	default:
		return errkind.Errorf(ErrInvalid, "kd_loss %q: want fwd_kl, rev_kl or jsd", o.KD)
	}
	switch o.Tail {
	case Bucket, Renormalize, Zero:
	default:
		return errkind.Errorf(ErrInvalid, "tail %q: want bucket, renormalize or zero", o.Tail)
	}
	switch o.Targets {
	case "", TopK:
	case Sampled, HeadSampled:
		if err := o.validateSampled(); err != nil {
			return err
		}
	default:
		return errkind.Errorf(ErrInvalid, "targets %q: want topk, sampled or head+sampled", o.Targets)
	}
	if o.Tail == Zero && o.KD != FwdKL {
		why := "rev_kl against it is infinite whenever the student has mass outside the top-k"
		if o.KD == JSD {
			why = "jsd runs up to rev_kl (jsd_beta 1), which against it is infinite whenever the student has mass outside the top-k"
		}
		return errkind.Errorf(ErrInvalid, "kd_loss %s with tail zero: tail zero (the teacher is 0 outside its top-k) is defined for kd_loss fwd_kl only; %s; use tail renormalize or bucket, or kd_loss fwd_kl",
			o.KD, why)
	}
	// (Checked whatever kd_loss: a jsd_beta out of range beside fwd_kl
	// is unused, but it is a mistake the user would meet only on
	// switching to jsd.)
	if !(o.Beta >= 0 && o.Beta <= 1) {
		return errkind.Errorf(ErrInvalid, "jsd beta %g: want 0 <= beta <= 1", o.Beta)
	}
	if !(o.Temperature > 0) || math.IsInf(o.Temperature, 0) {
		return errkind.Errorf(ErrInvalid, "temperature %g: want a finite value > 0", o.Temperature)
	}
	if !(o.TeacherTemperature >= 0) || math.IsInf(o.TeacherTemperature, 0) {
		return errkind.Errorf(ErrInvalid, "teacher temperature %g: want a finite value > 0 (0 means 1)", o.TeacherTemperature)
	}
	if o.Tail == Bucket && o.teacherT() != o.Temperature {
		return errkind.Errorf(ErrInvalid, "tail=bucket with temperature %g but the teacher was captured at %g: the teacher's tail mass at another temperature is unknown from a top-k; use tail=renormalize (or zero) or capture the teacher at temperature %g",
			o.Temperature, o.teacherT(), o.Temperature)
	}
	if !(o.KDWeight >= 0) || !(o.SFTWeight >= 0) || math.IsInf(o.KDWeight, 0) || math.IsInf(o.SFTWeight, 0) {
		return errkind.Errorf(ErrInvalid, "kd_weight %g, sft_weight %g: want finite values >= 0", o.KDWeight, o.SFTWeight)
	}
	if o.KDWeight == 0 && o.SFTWeight == 0 {
		return errkind.Errorf(ErrInvalid, "kd_weight and sft_weight are both 0: nothing to train on (SFT on the labels alone: kd_weight 0 with sft_weight 1; KD: kd_weight > 0)")
	}
	return nil
}

// validateSampled refuses what sampled targets cannot be: see Sampled
// targets in the package doc.
func (o *Options) validateSampled() error {
	if o.KD != FwdKL {
		return errkind.Errorf(ErrInvalid, "kd_loss %s with targets %s: only fwd_kl (equivalently cross-entropy) is unbiased on sampled targets: %s is nonlinear in the teacher's probabilities, which the draws estimate, and is infinite where the student has mass on an id nothing was drawn at; use kd_loss fwd_kl, or a targets topk cache",
			o.KD, o.Targets, o.KD)
	}
	if o.teacherT() != o.Temperature {
		return errkind.Errorf(ErrInvalid, "temperature %g with targets %s captured at %g: tempering sampled targets is biased; set the temperature to %g, or fill a cache at temperature %g",
			o.Temperature, o.Targets, o.teacherT(), o.teacherT(), o.Temperature)
	}
	if o.Tail != Bucket {
		return errkind.Errorf(ErrInvalid, "tail %s with targets %s: the tail modes are for top-k targets; sampled targets carry the tail's mass themselves: leave tail at its default (bucket)", o.Tail, o.Targets)
	}
	return nil
}

// sparse reports whether the teacher rows are sampled targets.
func (o *Options) sparse() bool { return o.Targets == Sampled || o.Targets == HeadSampled }

func (o *Options) teacherT() float64 {
	if o.TeacherTemperature == 0 {
		return 1
	}
	return o.TeacherTemperature
}

// Targets are one packed batch's labels and teacher top-k.
type Targets struct {
	Tokens []int32 // (N) the packed token ids
	Starts []int32 // (nSeq+1) sample boundaries, 0 = Starts[0] < ... < Starts[nSeq] = N
	Mask   []uint8 // (N) 1 where the token is a training target
	K      int     // teacher top-k per position (0 for SFT only)
	TopIDs []int32 // (N, K) teacher ids at each position, distinct per row
	TopLP  []float32
	// TopLP (N, K): teacher log-probs normalized over the full vocabulary.

	// Teachers, when set, replace K, TopIDs and TopLP (which must then be
	// unset): several teachers' top-k over the same tokens, and the KD
	// term is the weighted sum of their divergences (see Multi-teacher KD
	// in the package doc).
	Teachers []Teacher
}

// Teacher is one teacher's top-k over a packed batch, for multi-teacher
// KD (Targets.Teachers).
type Teacher struct {
	// Weight w_t of this teacher's divergence in the KD term (>= 0).
	Weight float64
	K      int       // its top-k per position
	TopIDs []int32   // (N, K) ids, distinct per row, by descending probability
	TopLP  []float32 // (N, K) log-probs normalized over the full vocabulary
	// Targets is the kind of this teacher's rows ("": Options.Targets):
	// teachers of different kinds mix (see Multi-teacher KD).
	Targets TargetKind
}

// TeacherStats are one teacher's numbers over a batch's counted
// positions (multi-teacher KD).
type TeacherStats struct {
	// KD is the teacher's divergence D_t, a mean over the counted
	// positions, before its weight, KDWeight and T².
	KD float64
	// Top1 is the fraction of counted positions where the student's
	// argmax over the whole vocabulary (ties: lowest id) is the teacher's
	// top-1 (its rank 0).
	Top1 float64
}

// Stats are one batch's loss values, means over the counted positions.
type Stats struct {
	Loss   float64 // the weighted total that the gradient is of
	KD     float64 // the divergence, before KDWeight and T²
	CE     float64 // cross-entropy on the labels
	Tokens int     // counted positions
	// Teachers are the per-teacher numbers of a multi-teacher batch
	// (Targets.Teachers), in its order; KD is then Σ_t w_t·Teachers[t].KD.
	Teachers []TeacherStats
	// Aux is an MoE student's load-balancing loss (HF Qwen3-MoE's,
	// before router_aux_loss_coef); Loss includes coef·Aux when the
	// config's output_router_logits is on. 0 for dense students.
	Aux float64
}

// Head is the fused LM head + loss on a backend. It keeps its host
// scratch between calls.
type Head struct {
	Backend compute.Backend
	V, C    int // vocabulary and hidden sizes
	// TileCols is the vocabulary tile width; 0 lets the backend choose
	// (the CPU backend: one (tokens x tile) fp32 block of 64 MiB).
	TileCols int
	// KeepLogits lets the backend keep pass 1's logits for pass 2
	// (compute.LossHead.Keep): 4·M·V bytes more while a row's loss head
	// runs, one GEMM of the three a tile fewer. The trainer sets it when
	// its memory plan has room (train.PlanShape.KeepLogits).
	KeepLogits bool

	// Per counted position (M of them), reused across calls.
	rows, labs []int32   // (M) index into the batch, label id
	ids        []int32   // (M,K) teacher ids in ascending order
	order      []int32   // (M,K) rank j of the c-th ascending id
	col        []int32   // (M,K) column c of rank j (runDevice)
	lpCol      []float32 // (M,K) the teacher's log-probs in column order (runDevice)
	stamp      []int32   // (V) duplicate-id detector
	rowD       []float64 // (M) a position's divergence (singleCoefs)
	rowCE      []float64 // (M) a position's CE

	// Multi-teacher scratch (multi.go).
	ustamp, slot []int32 // (V) union membership of the row, column of an id
	topkRows     int     // positions of the last call whose argmax needed the LM head's top-1
}

// Check validates the packing and the token ids of a batch for a
// vocabulary of V (the teacher top-k is checked by the loss, per counted
// position), naming the sample or token at fault.
func (tg *Targets) Check(V int) error {
	N := len(tg.Tokens)
	if len(tg.Mask) != N {
		return fmt.Errorf("%w: mask has %d entries for %d tokens", ErrInvalid, len(tg.Mask), N)
	}
	if len(tg.Starts) < 2 || tg.Starts[0] != 0 || int(tg.Starts[len(tg.Starts)-1]) != N {
		return fmt.Errorf("%w: sample starts %v must begin at 0 and end at the token count %d", ErrInvalid, head(tg.Starts), N)
	}
	for s := 0; s+1 < len(tg.Starts); s++ {
		if tg.Starts[s+1] <= tg.Starts[s] {
			return fmt.Errorf("%w: sample %d is empty or out of order (starts %d, %d)", ErrInvalid, s, tg.Starts[s], tg.Starts[s+1])
		}
	}
	for t, id := range tg.Tokens {
		if id < 0 || int(id) >= V {
			return fmt.Errorf("%w: token %d has id %d outside the vocabulary [0,%d)", ErrInvalid, t, id, V)
		}
	}
	return nil
}

// Validate checks targets against the head and the options, naming the
// position and the field at fault.
func (h *Head) validate(x compute.Tensor, tg *Targets, opt *Options) error {
	if err := h.checkBatch(x, tg); err != nil {
		return err
	}
	N := len(tg.Tokens)
	if opt.KDWeight > 0 {
		if tg.K <= 0 || tg.K > h.V {
			return fmt.Errorf("%w: teacher k = %d: want 1 <= k <= vocab %d (kd_weight > 0 needs teacher top-k)", ErrInvalid, tg.K, h.V)
		}
		if len(tg.TopIDs) != N*tg.K || len(tg.TopLP) != N*tg.K {
			return fmt.Errorf("%w: teacher top-k has %d ids and %d log-probs, want tokens %d x k %d", ErrInvalid, len(tg.TopIDs), len(tg.TopLP), N, tg.K)
		}
	}
	return nil
}

// checkBatch checks the hidden states' size and the batch's packing and
// token ids.
func (h *Head) checkBatch(x compute.Tensor, tg *Targets) error {
	N := len(tg.Tokens)
	if x.Len() < N*h.C {
		return fmt.Errorf("%w: hidden states have %d values, want tokens %d x hidden %d", ErrInvalid, x.Len(), N, h.C)
	}
	return tg.Check(h.V)
}

func head(s []int32) []int32 {
	if len(s) > 8 {
		return s[:8]
	}
	return s
}

func growI(b []int32, n int) []int32 {
	if cap(b) < n {
		return make([]int32, n)
	}
	return b[:n]
}

func growF32(b []float32, n int) []float32 {
	if cap(b) < n {
		return make([]float32, n)
	}
	return b[:n]
}

func growF(b []float64, n int) []float64 {
	if cap(b) < n {
		return make([]float64, n)
	}
	return b[:n]
}

// Forward computes the loss without gradients (evaluation). x (N,C) are
// the final hidden states, w (V,C) the LM head (the embedding table when
// tied), tensors of h.Backend.
func (h *Head) Forward(x, w compute.Tensor, tg *Targets, opt *Options) (Stats, error) {
	p, err := h.run(x, w, nil, nil, tg, opt, 0)
	if err != nil {
		return Stats{}, err
	}
	return p.Stats(), nil
}

// ForwardBackward computes the loss and ADDS its gradient to dx (N,C) and
// dw (V,C). The gradient is of Stats.Loss, or of Stats.Loss·Tokens/
// normalizer when normalizer > 0 (gradient accumulation over micro-batches
// divides by the global count instead).
func (h *Head) ForwardBackward(x, w, dx, dw compute.Tensor, tg *Targets, opt *Options, normalizer float64) (Stats, error) {
	p, err := h.ForwardBackwardPending(x, w, dx, dw, tg, opt, normalizer)
	if err != nil {
		return Stats{}, err
	}
	return p.Stats(), nil
}

// Pending is a ForwardBackward whose loss values are still on the
// device: its gradient is issued, and Stats reads the values (the bits
// ForwardBackward returns) when the caller needs them, so that the host
// need not wait for the loss head in the middle of a step (a backend
// that computes pass 2's coefficients itself, compute.DeviceLossCoef;
// elsewhere the values are read already).
type Pending struct {
	st   Stats
	read func() Stats // nil: st is final
}

// Tokens is the counted positions, known before the values are read.
func (p *Pending) Tokens() int { return p.st.Tokens }

// Stats reads the loss values (once; later calls return the same) and
// returns the statistics ForwardBackward would have.
func (p *Pending) Stats() Stats {
	if p.read != nil {
		p.st, p.read = p.read(), nil
	}
	return p.st
}

// ForwardBackwardPending is ForwardBackward that leaves the loss values
// where they are (Pending): the trainer issues the decoder's backward
// and the step's update before it reads them.
func (h *Head) ForwardBackwardPending(x, w, dx, dw compute.Tensor, tg *Targets, opt *Options, normalizer float64) (*Pending, error) {
	return h.run(x, w, dx, dw, tg, opt, normalizer)
}

func (h *Head) run(x, w, dx, dw compute.Tensor, tg *Targets, opt *Options, normalizer float64) (*Pending, error) {
	if err := opt.Validate(); err != nil {
		return nil, err
	}
	if h.Backend == nil {
		return nil, fmt.Errorf("%w: the loss head has no backend", ErrInvalid)
	}
	if w.Len() != h.V*h.C {
		return nil, fmt.Errorf("%w: lm_head has %d values, want vocab %d x hidden %d", ErrInvalid, w.Len(), h.V, h.C)
	}
	if len(tg.Teachers) > 0 {
		if tg.K != 0 || tg.TopIDs != nil || tg.TopLP != nil {
			return nil, fmt.Errorf("%w: the targets set both one teacher's top-k (K, TopIDs, TopLP) and Teachers: set only Teachers for several teachers", ErrInvalid)
		}
		if opt.KDWeight > 0 || dx == nil {
			st, err := h.runMulti(x, w, dx, dw, tg, opt, normalizer)
			return &Pending{st: st}, err
		}
	}
	if err := h.validate(x, tg, opt); err != nil {
		return nil, err
	}
	// Without a gradient (evaluation), the divergence is a metric even at
	// kd_weight 0: an SFT-only run scored on a teacher's cache reports how
	// far it is from the teacher, and its loss (kd_weight·KD + ...) stays
	// what it trained on.
	useKD := opt.KDWeight > 0 || (dx == nil && tg.K > 0)
	K := 0
	if useKD {
		K = tg.K
	}
	h.countRows(tg)
	M := len(h.rows)
	if M == 0 {
		return &Pending{}, nil
	}
	// A training step on a backend that computes pass 2's coefficients
	// itself issues both passes back to back (runDevice); evaluation
	// (dx nil) has no pass 2 to wait for.
	dev, _ := h.Backend.(compute.DeviceLossCoef)
	if dx == nil || !deviceCovers(opt, K) {
		dev = nil
	}
	if err := h.sortTeacherRows(tg, opt, K, dev != nil); err != nil {
		return nil, err
	}
	call := h.newCall(x, w, dx, opt, h.ids, K)
	defer call.free()
	wkd, norm := opt.weights(M, normalizer)
	sft := opt.SFTWeight // (the caller may change opt before it reads a Pending)
	stats := func(kd, ce float64) Stats {
		st := Stats{KD: kd / float64(M), CE: ce / float64(M), Tokens: M}
		if !useKD {
			st.KD = 0
		}
		st.Loss = wkd*st.KD + sft*st.CE
		return st
	}
	if dev != nil {
		read := h.runDevice(dev, call, opt, K, wkd/norm, float32(opt.SFTWeight/norm), dx, dw)
		return &Pending{st: Stats{Tokens: M}, read: func() Stats { return stats(read()) }}, nil
	}
	ps := call.be.LossHeadForward(call.lh)
	co := newCoefs(M, K)
	kd, ce := h.singleCoefs(&ps, tg, opt, K, wkd/norm, co)
	if dx != nil {
		call.backward(co, float32(opt.SFTWeight/norm), dx, dw)
	}
	return &Pending{st: stats(kd, ce)}, nil
}

// deviceCovers reports whether a training step's pass-2 coefficients may
// be computed by the backend (compute.DeviceLossCoef): CE only (K 0), or
// one teacher's top-k under fwd_kl, the default and what users run most,
// under every tail mode. The rest keeps the host path: rev_kl and jsd
// (more transcendental terms, jsd's log of a mixture), multi-teacher KD
// (runMulti: union columns, per-teacher tails, the top-1 agreement's
// extra LM-head pass) and sampled targets (-Inf padding, no tail) would
// each need a second copy of their math on the device, held to the
// host's bits by its own tests, for configurations few runs use.
func deviceCovers(opt *Options, K int) bool {
	return K == 0 || opt.KD == FwdKL && !opt.sparse()
}

// runDevice issues pass 1, the coefficients (on the device, bit for bit
// what singleCoefs computes: compute.LossKD) and pass 2 without waiting
// in between, and returns the reading of the positions' loss values,
// which only the logs need: it returns their sums as singleCoefs does,
// and the caller calls it when it needs them (Pending), after the rest
// of the step is issued.
func (h *Head) runDevice(dev compute.DeviceLossCoef, call *headCall, opt *Options, K int, wn float64, wsft float32, dx, dw compute.Tensor) (read func() (kd, ce float64)) {
	be, M := call.be, len(h.rows)
	co := &compute.LossCoef{LseT: be.New(compute.F32, M), Lse1: be.New(compute.F32, M), A: be.New(compute.F32, M), WSFT: wsft}
	call.uploads = append(call.uploads, co.LseT, co.Lse1, co.A)
	var kt *compute.LossKD
	if K > 0 {
		m := newKDMath(opt, 0)
		co.CK = be.New(compute.F32, M*K)
		kt = &compute.LossKD{Tail: deviceTail[opt.Tail], LP: be.FromF32(h.lpCol), Col: be.FromI32(h.col),
			LPScale: m.tc / opt.Temperature, Scale: wn * m.invT}
		call.uploads = append(call.uploads, co.CK, kt.LP, kt.Col)
	}
	vals := dev.LossHeadForwardKD(call.lh, kt, co)
	be.LossHeadBackward(call.lh, co, dx, dw)
	// The values are read into buffers of their own: the head's are the
	// next call's before this one is read.
	return func() (kd, ce float64) {
		d, c := make([]float64, M), make([]float64, M)
		vals.Read(d, c)
		return sumRowValues(d, c, K)
	}
}

// deviceTail is compute's name of each tail mode.
var deviceTail = map[Tail]compute.LossTail{Bucket: compute.TailBucket, Renormalize: compute.TailRenormalize, Zero: compute.TailZero}

// sortTeacherRows checks the teacher's top-k of every counted position
// and writes each row's ids in ascending order to h.ids, the order the
// backend walks them in, with h.order[c] the rank of the c-th of them;
// for the device's coefficients (device) also h.col, the column of each
// rank (h.order's inverse), and h.lpCol, the log-probs in column order.
// K 0 (no KD term) leaves them empty.
func (h *Head) sortTeacherRows(tg *Targets, opt *Options, K int, device bool) error {
	M := len(h.rows)
	h.ids, h.order = growI(h.ids, M*K), growI(h.order, M*K)
	if device {
		h.col, h.lpCol = growI(h.col, M*K), growF32(h.lpCol, M*K)
	}
	if K == 0 {
		return nil
	}
	h.stamp = growI(h.stamp, h.V)
	clear(h.stamp)
	for n, t := range h.rows {
		row := tg.TopIDs[int(t)*K : int(t+1)*K]
		if err := h.checkTeacherRow(-1, t, row, tg.TopLP[int(t)*K:int(t+1)*K], int32(n+1), opt.sparse()); err != nil {
			return err
		}
	}
	// The checked ids are distinct and in [0, V): each row sorts as
	// integer keys id<<32 | rank (no comparison closure), its rows on
	// several goroutines (on a GPU this runs while the device computes
	// the forward: 24 ms for 8192 positions at k = 64 with sort.Slice).
	forRanges(len(h.rows), func(lo, hi int) {
		keys := make([]int64, K)
		for n := lo; n < hi; n++ {
			t := h.rows[n]
			row := tg.TopIDs[int(t)*K : int(t+1)*K]
			for j, id := range row {
				keys[j] = int64(id)<<32 | int64(j)
			}
			slices.Sort(keys)
			for c, key := range keys {
				h.order[n*K+c], h.ids[n*K+c] = int32(key&0xffffffff), int32(key>>32)
			}
			if device {
				lp := tg.TopLP[int(t)*K : int(t+1)*K]
				for c, j := range h.order[n*K : (n+1)*K] {
					h.col[n*K+int(j)], h.lpCol[n*K+c] = int32(c), lp[j]
				}
			}
		}
	})
	return nil
}

// checkTeacherRow checks a teacher's top-k at token t: ids in the
// vocabulary and distinct (h.stamp marks the row's ids with mark, which no
// other row uses), log-probs finite and <= 0 (a small positive slack
// absorbs cache quantization; -Inf, a padding entry of r = 0, only for
// sampled targets). teacher numbers the teacher in the message of several
// (-1: the only one).
func (h *Head) checkTeacherRow(teacher int, t int32, ids []int32, lps []float32, mark int32, sparse bool) error {
	for j, id := range ids {
		lp := lps[j]
		if id < 0 || int(id) >= h.V {
			return fmt.Errorf("%w: %stop-k at token %d, rank %d: id %d outside the vocabulary [0,%d)", ErrInvalid, teacherName(teacher), t, j, id, h.V)
		}
		if h.stamp[id] == mark {
			return fmt.Errorf("%w: %stop-k at token %d lists id %d twice", ErrInvalid, teacherName(teacher), t, id)
		}
		h.stamp[id] = mark
		if sparse && math.IsInf(float64(lp), -1) {
			continue
		}
		if !(lp <= 1e-3) || math.IsInf(float64(lp), 0) {
			return fmt.Errorf("%w: %slog-prob at token %d, rank %d is %g: want a finite log-probability <= 0", ErrInvalid, teacherName(teacher), t, j, lp)
		}
	}
	return nil
}

// teacherName is how messages start that name a teacher: "teacher " for
// the only one, "teacher i: " for one of several.
func teacherName(teacher int) string {
	if teacher < 0 {
		return "teacher "
	}
	return fmt.Sprintf("teacher %d: ", teacher)
}

// singleCoefs is the per-position loss and gradient coefficients of one
// teacher (K 0: CE only), in float64, written to co with the scale wn =
// kd weight / norm; it returns the sums of the divergence and of the CE.
// The positions are independent: goroutines take ranges of them (where a
// GPU takes this path, evaluation or a configuration deviceCovers leaves
// out, this host work runs while the device waits between the loss head's
// forward and backward: 13 ms for 8192 positions at k = 64 on one core),
// and the sums add the per-position terms in position order, as one
// loop would. runDevice's k_loss_coef is its copy on the device.
func (h *Head) singleCoefs(ps *compute.LossStats, tg *Targets, opt *Options, K int, wn float64, co *coefs) (kd, ce float64) {
	M := len(h.rows)
	h.rowD, h.rowCE = growF(h.rowD, M), growF(h.rowCE, M)
	forRanges(M, func(lo, hi int) {
		m := newKDMath(opt, K)
		scale := wn * m.invT
		for r := lo; r < hi; r++ {
			h.rowCE[r] = co.keepLse(ps, r)
			if K == 0 {
				continue
			}
			t := int(h.rows[r])
			o := h.order[r*K : (r+1)*K]
			for c, j := range o {
				m.zK[j] = float64(ps.ZK[r*K+c])
			}
			qTail := 0.0
			if opt.Tail == Bucket {
				qTail = ps.Tail[r]
			}
			D, H, out := m.term(tg.TopLP[t*K:(t+1)*K], ps.LseT[r], qTail)
			h.rowD[r] = D
			for ci, j := range o {
				co.cK[r*K+ci] = float32(scale * m.coefK(int(j), H))
			}
			co.a[r] = clampCoef(scale * out)
		}
	})
	return h.sumRows(K)
}

// sumRows returns the sums of h.rowD (with K > 0) and h.rowCE, in
// position order, as one loop would.
func (h *Head) sumRows(K int) (kd, ce float64) {
	return sumRowValues(h.rowD[:len(h.rows)], h.rowCE[:len(h.rows)], K)
}

// sumRowValues returns the sums of d (with K > 0) and ce, in position
// order, as one loop would.
func sumRowValues(d, ce []float64, K int) (kdSum, ceSum float64) {
	for r := range ce {
		ceSum += ce[r]
		if K > 0 {
			kdSum += d[r]
		}
	}
	return kdSum, ceSum
}

// forRanges calls f on consecutive ranges [lo, hi) covering [0, n), from
// up to GOMAXPROCS goroutines when n is large enough to pay for them, and
// returns when all are done. f must write only its own range's outputs.
func forRanges(n int, f func(lo, hi int)) {
	const minRange = 512
	workers := min(runtime.GOMAXPROCS(0), n/minRange)
	if workers <= 1 {
		f(0, n)
		return
	}
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		lo, hi := n*w/workers, n*(w+1)/workers
		wg.Add(1)
		go func() {
			defer wg.Done()
			f(lo, hi)
		}()
	}
	wg.Wait()
}

// countRows sets h.rows and h.labs to the counted positions: t -> label
// t+1 in the same sample, masked in.
func (h *Head) countRows(tg *Targets) {
	h.rows, h.labs = h.rows[:0], h.labs[:0]
	for s := 0; s+1 < len(tg.Starts); s++ {
		for t := tg.Starts[s]; t+1 < tg.Starts[s+1]; t++ {
			if tg.Mask[t+1] != 0 {
				h.rows = append(h.rows, t)
				h.labs = append(h.labs, tg.Tokens[t+1])
			}
		}
	}
}

// logSoftmaxK writes log softmax(lp·f) over the k entries of lp to out.
func logSoftmaxK(out []float64, lp []float32, f float64) {
	for j, v := range lp {
		out[j] = float64(v) * f
	}
	ls := logSumExp(out)
	for j := range out {
		out[j] -= ls
	}
}

// logSumExp is log Σ exp(a_j), shifted by the maximum.
func logSumExp(a []float64) float64 {
	mx := math.Inf(-1)
	for _, v := range a {
		mx = math.Max(mx, v)
	}
	var s float64
	for _, v := range a {
		s += compute.Exp(v - mx)
	}
	return mx + compute.Log(s)
}

// tailFloor bounds the tail buckets' probabilities from below inside logs.
const tailFloor = 1e-30

// divergence returns the divergence between teacher log-probs lp and
// student log-probs lq over the same entries, and writes h_e = ∂/∂lq_e.
func divergence(opt *Options, lp, lq, h []float64) float64 {
	beta := opt.Beta
	kind := opt.KD
	if kind == JSD && beta == 0 {
		kind = FwdKL
	}
	if kind == JSD && beta == 1 {
		kind = RevKL
	}
	var L float64
	switch kind {
	case FwdKL:
		for e := range lp {
			p := compute.Exp(lp[e])
			h[e] = -p
			if p > 0 {
				L += float64(p * (lp[e] - lq[e]))
			}
		}
	case RevKL:
		for e := range lp {
			q := compute.Exp(lq[e])
			L += q * (lq[e] - lp[e])
			h[e] = q * (lq[e] - lp[e] + 1)
		}
	case JSD:
		for e := range lp {
			p, q := compute.Exp(lp[e]), compute.Exp(lq[e])
			m := beta*p + (1-beta)*q
			if m <= 0 {
				h[e] = 0
				continue
			}
			lm := compute.Log(m)
			if p > 0 {
				L += beta * p * (lp[e] - lm)
			}
			L += (1 - beta) * q * (lq[e] - lm)
			h[e] = (1 - beta) * q * (lq[e] - lm)
		}
	}
	return L
}

// teacherDists fills one position's teacher distribution lp and the
// student's lq over the teacher's K ids (zK: the student's logits there,
// in the teacher's order; topLP: the teacher's log-probs) under opt.Tail,
// and returns how many entries the divergence runs over: K, or K+1 with
// the tail bucket, whose lp[K] it sets (1 - Σ p, floored); the caller
// sets the student's bucket lq[K] from its tail mass, summed directly.
func teacherDists(opt *Options, lp, lq, zK []float64, topLP []float32, tc, invT, lseT float64) int {
	K := len(zK)
	if opt.sparse() {
		// The target r as given (log r, normalized over the vocabulary
		// by construction) against the full-vocabulary lq.
		for j := 0; j < K; j++ {
			lp[j] = float64(topLP[j])
			lq[j] = float64(zK[j]*invT) - lseT
		}
		return K
	}
	switch opt.Tail {
	case Renormalize, Zero:
		logSoftmaxK(lp[:K], topLP, tc/opt.Temperature)
		if opt.Tail == Renormalize {
			// q̃ = softmax_K(z_K/T), straight from the gathered logits.
			for j := 0; j < K; j++ {
				lq[j] = zK[j] * invT
			}
			lseK := logSumExp(lq[:K])
			for j := 0; j < K; j++ {
				lq[j] -= lseK
			}
		} else {
			for j := 0; j < K; j++ {
				lq[j] = float64(zK[j]*invT) - lseT
			}
		}
		return K
	default: // Bucket
		var psum float64
		for j := 0; j < K; j++ {
			lq[j] = float64(zK[j]*invT) - lseT
			lp[j] = float64(topLP[j])
			psum += compute.Exp(lp[j])
		}
		lp[K] = compute.Log(math.Max(1-psum, tailFloor))
		return K + 1
	}
}
