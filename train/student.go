// Package train is the student side of distillation: the Student model
// (Llama, Qwen2, Qwen3, Qwen3-MoE) trained on a packed batch through the decoder
// of package model/decoder, the one the teacher runs, on any
// compute.Backend: forward saving activations, the fused KD+SFT loss
// (train/loss), backward, AdamW (train/optim) and optional NVFP4
// quantization-aware distillation (the decoder's QAD, exported by
// train/nvfp4). The backend's package doc states the = / += rules of every
// kernel.
//
// Memory: parameters and their gradients are two backend arenas laid out in
// the order of model.Config.Tensors() (HF names), every tensor a view; the
// decoder carves a batch's activations out of one more.
package train

import (
	"errors"
	"fmt"

	"distill/compute"
	"distill/compute/device"
	"distill/model"
	"distill/model/decoder"
	"distill/train/loss"
	"distill/train/optim"
)

// ErrInvalid is wrapped by errors about unsupported configs, bad weights
// and bad batches.
var ErrInvalid = errors.New("train: invalid input")

// Tensor is one parameter: its HF name, shape and place in the arenas.
type Tensor struct {
	Name   string
	Shape  []int
	Off, N int
	Decay  bool // weight decay applies (not norms, not biases)
}

// Student is a decoder-only model being trained (dense or Qwen3-MoE).
type Student struct {
	Cfg     *model.Config
	Tensors []Tensor
	// Params and Grads are host views of the parameter and gradient arenas
	// (fp32 master weights), for checkpoints and tests. They alias the
	// backend's memory on a host backend (compute.Host, the CPU); they are
	// nil on a device backend, where Weights downloads instead.
	Params, Grads []float32
	// Model is the decoder the student trains; its tensors are views of
	// the arenas.
	Model *decoder.Model

	// QAD is true once EnableQAD or RestoreQAD ran: Linear weights and
	// inputs are fake quantized (lm_head and embeddings excluded).
	QAD bool

	be            compute.Backend
	params, grads compute.Tensor // nil when sharded
	sh            *shards        // ZeRO stages 2 and 3 (NewShardedStudentOn)
	dp            *dpBuckets     // data parallel at ZeRO 0 and 1: the buckets (ReduceInBackward)
	lora          *loraState     // a LoRA student (NewLoRAStudentOn): its frozen base
	head          *loss.Head
	row           *stepRow // the next ForwardBackward's place (SetStepRow)
}

// NewStudent allocates a model of cfg with zero parameters (Load or
// LoadHF fill them) on the CPU backend with one worker per core; see
// NewStudentOn for another backend.
func NewStudent(cfg *model.Config) (*Student, error) {
	return NewStudentOn(cfg, device.CPU(0))
}

// NewStudentOn allocates a model of cfg with zero parameters on be:
// Llama, Qwen2, Qwen3 or Qwen3-MoE.
func NewStudentOn(cfg *model.Config, be compute.Backend) (_ *Student, err error) {
	return newStudent(cfg, be, nil)
}

// NewShardedStudentOn is NewStudentOn for one rank of a ZeRO stage 2 or
// 3 group (see Sharding): the rank holds its part of the parameters'
// master weights, gradients and moments. Every rank of the group makes
// its student of the same config.
func NewShardedStudentOn(cfg *model.Config, be compute.Backend, sh Sharding) (_ *Student, err error) {
	return newStudent(cfg, be, &sh)
}

func newStudent(cfg *model.Config, be compute.Backend, sh *Sharding) (_ *Student, err error) {
	defer recoverOOM(&err, "allocating the student's parameters and gradients")
	switch cfg.Arch {
	case model.ArchLlama, model.ArchQwen2, model.ArchQwen3, model.ArchQwen3MoE:
	default:
		return nil, fmt.Errorf("%w: student architecture %q: want llama, qwen2, qwen3 or qwen3_moe", ErrInvalid, cfg.Arch)
	}
	if cfg.Arch == model.ArchQwen3MoE {
		if err := compute.Lacks(be, compute.FeatureMoETraining); err != nil {
			return nil, fmt.Errorf("%w: a %s student on the %s backend: %w", ErrInvalid, cfg.Arch, be.Name(), err)
		}
	}
	s := &Student{Cfg: cfg, be: be}
	off := 0
	byName := map[string]int{}
	for _, ts := range cfg.Tensors() {
		n := 1
		for _, d := range ts.Shape {
			n *= d
		}
		byName[ts.Name] = len(s.Tensors)
		s.Tensors = append(s.Tensors, Tensor{Name: ts.Name, Shape: ts.Shape, Off: off, N: n, Decay: !ts.Norm && !ts.Bias})
		off += n
	}
	if sh != nil {
		if s.sh, err = newShards(s, *sh); err != nil {
			return nil, err
		}
	} else {
		s.params, s.grads = be.New(compute.F32, off), be.New(compute.F32, off)
		if h, ok := be.(compute.Host); ok {
			s.Params, s.Grads = h.HostF32(s.params), h.HostF32(s.grads)
		}
	}
	m, err := decoder.New(cfg, be, func(name string) (compute.Tensor, compute.Tensor, error) {
		i, ok := byName[name]
		if !ok {
			return nil, nil, fmt.Errorf("%w: the decoder asks for %s, which is not a tensor of a %s config", ErrInvalid, name, cfg.Arch)
		}
		t := s.Tensors[i]
		if s.sh != nil {
			w, g := s.sh.views(i, t)
			return w, g, nil
		}
		return be.View(s.params, t.Off, t.N), be.View(s.grads, t.Off, t.N), nil
	})
	if err != nil {
		if s.sh != nil {
			s.sh.free()
		}
		return nil, fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	if s.sh != nil {
		m.SetResidency(s.sh)
	}
	s.Model = m
	s.head = &loss.Head{Backend: be, V: cfg.VocabSize, C: cfg.Hidden}
	return s, nil
}

// SetKeepLogits lets the loss head keep each row's logits between its two
// passes (loss.Head.KeepLogits): 4·M·V bytes more while it runs, for one
// GEMM of its three a vocabulary tile fewer; the same results. The
// trainer sets it when the memory plan has room for them
// (PlanShape.KeepLogits).
func (s *Student) SetKeepLogits(on bool) { s.head.KeepLogits = on }

// Free releases the student's device memory (parameters, gradients, the
// decoder's activations and QAD weights): on a device backend, whose
// memory the garbage collector does not see, a student no longer used
// must be freed before another one is made. The student is unusable
// after.
func (s *Student) Free() {
	if s.Model != nil {
		s.Model.Free()
	}
	if s.dp != nil {
		s.dp.free()
	}
	if s.sh != nil {
		s.sh.free()
	} else {
		s.be.Free(s.params)
		s.be.Free(s.grads)
	}
	if st := s.lora; st != nil {
		if st.base != nil {
			s.be.Free(st.base)
		}
		st.base = nil
	}
	s.Params, s.Grads = nil, nil
}

// Backend returns the backend the student trains on.
func (s *Student) Backend() compute.Backend { return s.be }

// Load copies weights by HF name. A missing, extra or mis-sized tensor is
// an error naming it.
func (s *Student) Load(w map[string][]float32) error {
	for _, t := range s.Tensors {
		v, ok := w[t.Name]
		if !ok {
			return fmt.Errorf("%w: missing tensor %s (shape %v)", ErrInvalid, t.Name, t.Shape)
		}
		if len(v) != t.N {
			return fmt.Errorf("%w: tensor %s has %d values, want shape %v = %d", ErrInvalid, t.Name, len(v), t.Shape, t.N)
		}
	}
	if len(w) != len(s.Tensors) {
		known := map[string]bool{}
		for _, t := range s.Tensors {
			known[t.Name] = true
		}
		for name := range w {
			if !known[name] {
				return fmt.Errorf("%w: unexpected tensor %s for a %s student", ErrInvalid, name, s.Cfg.Arch)
			}
		}
	}
	for i, t := range s.Tensors {
		s.write(i, w[t.Name])
	}
	return nil
}

// write stores tensor i's whole values.
func (s *Student) write(i int, v []float32) {
	t := s.Tensors[i]
	if s.sh != nil {
		s.sh.write(i, t, v)
		return
	}
	s.be.WriteF32(s.be.View(s.params, t.Off, t.N), v)
}

// Groups returns the optimizer's parameter groups, one per tensor, with
// weight decay off for norms and biases.
//
// Sharded (ZeRO stages 2 and 3), they are this rank's pieces of the
// tensors instead (ShardPieces says which).
func (s *Student) Groups() []optim.Group {
	if s.sh != nil {
		return s.sh.groups(s.Tensors)
	}
	gs := make([]optim.Group, len(s.Tensors))
	for i, t := range s.Tensors {
		g := optim.Group{Name: t.Name, Decay: t.Decay, Backend: s.be,
			P: s.be.View(s.params, t.Off, t.N), G: s.be.View(s.grads, t.Off, t.N)}
		if s.Params != nil {
			g.Params, g.Grads = s.Params[t.Off:t.Off+t.N:t.Off+t.N], s.Grads[t.Off:t.Off+t.N:t.Off+t.N]
		}
		gs[i] = g
	}
	return gs
}

// ZeroGrad clears every gradient (one Zero over the arena).
func (s *Student) ZeroGrad() {
	if s.sh != nil {
		s.sh.zeroGrad()
		return
	}
	if s.dp != nil {
		s.dp.reset()
	}
	s.be.Zero(s.grads)
}

// ParamsView is elements [off, off+n) of the parameter arena (the
// tensors laid out in Tensors' order, at their Off): what ZeRO-1 ranks
// broadcast. Not for a sharded student.
func (s *Student) ParamsView(off, n int) compute.Tensor { return s.be.View(s.params, off, n) }

// AllReduceGrads sums the gradients over the ranks of c (data-parallel
// training), in place; a sharded student's are reduce-scattered instead
// (the blocks' during the backward, the rest here): each rank then holds
// the sums of its pieces. After a backward armed by ReduceInBackward, the
// blocks' were all-reduced during it, and the rest are here.
func (s *Student) AllReduceGrads(c compute.Collective) {
	switch {
	case s.sh != nil:
		s.sh.reduceRest()
	case s.dp != nil:
		s.dp.finish(c)
	default:
		c.AllReduceSum(s.grads, s.grads.Len())
	}
}

// ReduceInBackward makes the next ForwardBackward, the last of this
// rank's rows of the step, all-reduce each block's gradients over c as
// soon as its backward is done, beside the blocks' backwards that follow
// (see dpBuckets; AllReduceGrads then does the rest). Every rank of c
// calls AllReduceGrads after its rows, armed or not (a rank without a
// row reduces every block there, in the same order). Nothing for a
// sharded or LoRA student, or a backend that cannot run work beside its
// kernels (compute.Overlapper): AllReduceGrads reduces it all.
func (s *Student) ReduceInBackward(c compute.Collective) {
	if _, ok := s.be.(compute.Overlapper); !ok || s.sh != nil || s.lora != nil {
		return
	}
	if s.dp == nil {
		s.dp = newDPBuckets(s)
		s.Model.SetResidency(s.dp)
	}
	s.dp.c, s.dp.armed = c, true
}

// ShardStage is the student's ZeRO stage when sharded (2 or 3), else 0.
func (s *Student) ShardStage() int {
	if s.sh == nil {
		return 0
	}
	return s.sh.stage
}

// ShardPieces are rank r's optimizer groups of a sharded student, in
// Groups' order on that rank: which part of which tensor each holds.
func (s *Student) ShardPieces(r int) []Piece {
	ps, _ := s.sh.pieces(s.Tensors, r)
	return ps
}

// AfterStep makes a sharded student's whole weights follow its updated
// master pieces (a collective: every rank calls it after the optimizer
// step); nothing for an unsharded one.
func (s *Student) AfterStep() {
	if s.sh != nil {
		s.sh.afterStep()
	}
}

// Phantom runs the collectives of one Forward (backward false) or one
// ForwardBackward without a batch: a rank of a sharded group with fewer
// rows than the others in a step or an eval keeps in step with them.
// Nothing for an unsharded student.
func (s *Student) Phantom(backward bool) {
	if s.sh != nil {
		s.Model.Phantom(backward)
	}
}
