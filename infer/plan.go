package infer

import (
	"errors"
	"fmt"
	"strconv"
	"strings"

	"distill/compute"
	"distill/model"
	"distill/model/decoder"
)

// The teacher's memory plan on paper (issue 29's first part): how a
// model of a config.json would be laid out over G GPUs of equal memory
// and the largest forward (token budget) each GPU then holds, computed
// from the config alone, with no weights loaded and no GPU needed. The
// layers are split into G contiguous stages balanced by bytes, the
// embedding on the first GPU and the final norm and LM head on the last
// (a tied head is the embedding: the last GPU holds a copy). Each GPU
// holds its stage's weights, the activations of a forward of the budget
// (the decoder's buffers, reused layer to layer, as on one GPU), the
// residual stream handed from and to its neighbours, and the largest
// kernel scratch of its layers (the LM head's on the last).
//
// Only one GPU runs a teacher today: the split is the plan the
// multi-GPU pipeline will follow, and its single-GPU case is what
// CheckDeviceFit checks at start-up.

// ErrPlan marks a teacher plan that cannot be made as asked.
var ErrPlan = errors.New("infer: invalid teacher plan")

// WeightFormat is how the plan stores a teacher's weights on the GPU.
type WeightFormat string

// Weight formats.
const (
	WeightsBF16 WeightFormat = "bf16"
	// WeightsFP8: the Linear weights as E4M3 with a fp32 scale per output
	// channel; embeddings, norms, routers and the LM head in BF16
	// (LoadOptions, teacherd --weights fp8).
	WeightsFP8 WeightFormat = "fp8"
)

// PlanOptions are a teacher plan's inputs beside the config.
type PlanOptions struct {
	GPUs        int
	DeviceBytes int64 // each GPU's memory
	Weights     WeightFormat
	K           int // the largest top-k asked for
	MaxLen      int // the longest sample (0: max_position_embeddings)
	// Scratch bounds the kernel scratch of a forward of a shape on the
	// GPU (compute/device.ForwardScratchBound).
	Scratch func(compute.ForwardShape) int64
}

// StagePlan is one GPU's share.
type StagePlan struct {
	FirstLayer, EndLayer int  // the decoder layers [FirstLayer, EndLayer)
	Embed, Head          bool // the embedding; the final norm and the LM head
	WeightBytes          int64
	// Budget is the largest forward (tokens) that fits beside the
	// weights; BudgetBytes what that forward takes.
	Budget      int
	BudgetBytes int64
}

// TeacherPlan is a teacher laid out over GPUs.
type TeacherPlan struct {
	Opts    PlanOptions
	Stages  []StagePlan
	Reserve int64 // kept free on each GPU (pool rounding, libraries)
	// Budget is the token budget of the whole teacher: the smallest of
	// its stages' (0: the weights alone do not fit some GPU).
	Budget int
}

// PlanTeacher lays a model of cfg out over o.GPUs GPUs.
func PlanTeacher(cfg *model.Config, o PlanOptions) (TeacherPlan, error) {
	if o.GPUs < 1 {
		return TeacherPlan{}, fmt.Errorf("%w: %d GPUs: want at least 1", ErrPlan, o.GPUs)
	}
	if o.Weights == "" {
		o.Weights = WeightsBF16
	}
	if o.Weights != WeightsBF16 && o.Weights != WeightsFP8 {
		return TeacherPlan{}, fmt.Errorf("%w: weights %q: want bf16 or fp8", ErrPlan, o.Weights)
	}
	if o.MaxLen <= 0 {
		o.MaxLen = cfg.MaxPositions
	}
	o.K = max(o.K, 1)
	embed, layers, head := weightBytes(cfg, o.Weights)
	if o.GPUs > len(layers) {
		return TeacherPlan{}, fmt.Errorf("%w: %d GPUs for %d layers: at most %d stages (one layer each, the last with the head)", ErrPlan, o.GPUs, len(layers), len(layers))
	}
	p := TeacherPlan{Opts: o, Reserve: deviceReserve(o.DeviceBytes), Stages: splitLayers(embed, layers, head, o.GPUs)}
	p.Budget = -1
	for i := range p.Stages {
		st := &p.Stages[i]
		avail := o.DeviceBytes - p.Reserve - st.WeightBytes
		need := func(n int) int64 { return stageBytes(cfg, o, st, n) }
		if need(1) > avail {
			st.Budget = 0
		} else {
			lo, hi := 1, 1<<24 // the largest n with need(n) <= avail
			for need(hi) <= avail && hi < 1<<30 {
				hi *= 2
			}
			for lo < hi {
				mid := lo + (hi-lo+1)/2
				if need(mid) <= avail {
					lo = mid
				} else {
					hi = mid - 1
				}
			}
			st.Budget = lo
		}
		st.BudgetBytes = need(max(st.Budget, 1))
		if p.Budget < 0 || st.Budget < p.Budget {
			p.Budget = st.Budget
		}
	}
	return p, nil
}

// weightBytes are the bytes of the embedding, of each layer and of the
// final norm and LM head (the embedding's copy when tied), in format w.
func weightBytes(cfg *model.Config, w WeightFormat) (embed int64, layers []int64, head int64) {
	layers = make([]int64, cfg.Layers)
	for _, t := range cfg.Tensors() {
		n := int64(1)
		for _, d := range t.Shape {
			n *= int64(d)
		}
		b := 2 * n
		linear := len(t.Shape) == 2 && strings.HasPrefix(t.Name, "model.layers.") && !strings.HasSuffix(t.Name, ".mlp.gate.weight")
		if w == WeightsFP8 && linear {
			b = n + 4*int64(t.Shape[0]) // E4M3, a fp32 scale per output channel
		}
		switch {
		case t.Name == "model.embed_tokens.weight":
			embed += b
			if cfg.TieEmbeddings {
				head += b
			}
		case strings.HasPrefix(t.Name, "model.layers."):
			rest := strings.TrimPrefix(t.Name, "model.layers.")
			i, _ := strconv.Atoi(rest[:strings.IndexByte(rest, '.')])
			layers[i] += b
		default: // model.norm.weight, lm_head.weight
			head += b
		}
	}
	return embed, layers, head
}

// splitLayers cuts the layers into at most g contiguous stages, the
// embedding with the first and the head with the last, minimizing the
// largest stage's bytes: the smallest cap for which a greedy fill from
// the first layer makes at most g stages.
func splitLayers(embed int64, layers []int64, head int64, g int) []StagePlan {
	fill := func(capBytes int64) []StagePlan {
		var out []StagePlan
		cur := StagePlan{Embed: true, WeightBytes: embed}
		for i, b := range layers {
			if i == len(layers)-1 {
				b += head // the last layer brings the head along
			}
			if cur.EndLayer > cur.FirstLayer && cur.WeightBytes+b > capBytes {
				out = append(out, cur)
				cur = StagePlan{FirstLayer: i, EndLayer: i}
			}
			cur.EndLayer, cur.WeightBytes = i+1, cur.WeightBytes+b
		}
		cur.Head = true
		return append(out, cur)
	}
	// Fewer stages for a larger cap: the smallest cap that needs at most
	// g is the split with the smallest largest stage (a stage over the cap
	// holds one layer too big for it).
	fits := func(capBytes int64) bool { return len(fill(capBytes)) <= g }
	total := embed + head
	for _, b := range layers {
		total += b
	}
	lo, hi := int64(1), total
	for lo < hi {
		mid := lo + (hi-lo)/2
		if fits(mid) {
			hi = mid
		} else {
			lo = mid + 1
		}
	}
	return fill(lo)
}

// stageBytes is what a stage holds beside its weights for a forward of n
// tokens: the decoder's activations (those of the whole model: they are
// reused layer to layer, so a stage holds the same set), the residual
// stream received from the previous stage and sent to the next (fp32),
// and its largest kernel scratch; the LM head's top-k outputs and scratch
// on the last. One stage is DeviceBytes, what CheckDeviceFit checks.
func stageBytes(cfg *model.Config, o PlanOptions, st *StagePlan, n int) int64 {
	k := 0
	if st.Head {
		k = o.K
	}
	b := decoder.ActivationBytesOf(cfg, n, k, compute.BF16)
	for _, ends := range []bool{st.Embed, st.Head} {
		if !ends { // the residual stream from the previous stage, or to the next
			b += 4 * int64(n) * int64(cfg.Hidden)
		}
	}
	if o.Scratch != nil {
		s := compute.ForwardShape{Tokens: n, MaxLen: min(n, o.MaxLen), K: k, Hidden: cfg.Hidden, Heads: cfg.Heads, KVHeads: cfg.KVHeads,
			HeadDim: cfg.HeadDim, Intermediate: cfg.Intermediate, Vocab: cfg.VocabSize, FP8: o.Weights == WeightsFP8}
		if !st.Head {
			s.Vocab = 1 // no LM head on this stage
		}
		if cfg.NumExperts > 0 {
			s.Experts, s.TopK, s.MoEIntermediate = cfg.NumExperts, cfg.ExpertsPerTok, cfg.MoEIntermediate
		}
		b += o.Scratch(s)
	}
	return b
}
