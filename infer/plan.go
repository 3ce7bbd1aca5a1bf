package infer

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"distill/compute"
	"distill/internal/errkind"
	"distill/model"
	"distill/model/decoder"
)

// The teacher's memory plan on paper (issue 29): how a model of a
// config.json is laid out over G GPUs of equal memory and the largest
// forward (token budget) each GPU then holds, computed from the config
// alone, with no weights loaded and no GPU needed. The layers are split
// into G contiguous stages balanced by bytes, the embedding on the first
// GPU and the final norm and LM head on the last: the split a pipelined
// teacher (LoadStages) runs with. Each GPU holds, beside its stage's
// weights (and copies of two small tensors another GPU holds too: the
// next stage's first input norm, and a tied LM head's embedding):
//
//   - the activations of a forward of the budget: the decoder's buffers,
//     reused layer to layer (a stage holds the same set as one GPU would;
//     a micro-batch never exceeds the budget), and the top-k outputs on
//     the last GPU;
//   - the hand-off (every GPU but the last): the residual stream (fp32)
//     and the next layer's normed input (BF16) of the micro-batch it has
//     finished, kept until the next GPU has copied them;
//   - the sampled targets' uniforms, ids and tail mass (the last GPU, with
//     draws);
//   - the largest kernel scratch: the layers' (attention's copies and
//     workspace, GEMM operand copies, MoE's grouping) or, on the last GPU,
//     the LM head's (its logit tile and statistics), whichever is larger:
//     a forward never holds both.
//
// One GPU's plan is what CheckDeviceFit checks at start-up, with the
// device's free memory measured after loading instead of this arithmetic
// of the weights.

// ErrPlan marks a teacher plan that cannot be made as asked.
var ErrPlan = errors.New("infer: invalid teacher plan")

// WeightFormat is how the plan stores a teacher's weights on the GPU.
type WeightFormat string

// Weight formats.
const (
	WeightsBF16 WeightFormat = "bf16"
	// WeightsFP8: the decoder layers' Linear weights (attention and MLP
	// or expert projections) as E4M3, one byte a weight, with a fp32
	// scale per output channel; the embedding, the norms, the MoE routers
	// and the LM head stay BF16 (LoadOptions, teacherd --weights fp8).
	WeightsFP8 WeightFormat = "fp8"
)

// PlanOptions are a teacher plan's inputs beside the config.
type PlanOptions struct {
	// GPUs is the number of GPUs; Devices, when set, are their ordinals
	// (len(Devices) GPUs), named in the plan and its errors.
	GPUs        int
	Devices     []int
	DeviceBytes int64 // each GPU's memory
	Weights     WeightFormat
	K           int // the largest top-k asked for
	Draws       int // the most draws a position of sampled targets (0: none)
	MaxLen      int // the longest sample (0: max_position_embeddings)
	// Scratch splits the kernel scratch of a forward of a shape on the
	// GPU into the layers' and the LM head's
	// (compute/device.ForwardScratchTerms); nil: none.
	Scratch func(compute.ForwardShape) (layers, head int64)
}

// StageBytes is what a stage holds beside its weights for a forward, by
// term (the package comment above says what each is).
type StageBytes struct {
	Activations, Handoff, Draws int64
	Workspace, LMHead           int64 // the kernel scratch: the larger counts
}

// Total is the stage's bytes beside its weights: the kernel scratch
// counts the larger of the layers' and the LM head's.
func (b StageBytes) Total() int64 {
	return b.Activations + b.Handoff + b.Draws + max(b.Workspace, b.LMHead)
}

// StagePlan is one GPU's share.
type StagePlan struct {
	Device               int  // the GPU's ordinal
	FirstLayer, EndLayer int  // the decoder layers [FirstLayer, EndLayer)
	Embed, Head          bool // the embedding; the final norm and the LM head
	// WeightBytes are the stage's weights, CopyBytes included: those of
	// tensors another GPU holds too (the next stage's first input norm; a
	// tied LM head's embedding).
	WeightBytes, CopyBytes int64
	// Budget is the largest forward (tokens) that fits beside the
	// weights, 0 if none; Bytes what that forward (or one token) takes.
	Budget int
	Bytes  StageBytes
}

// What names the stage's share: "embedding, layers 0-39".
func (s StagePlan) What() string {
	w := fmt.Sprintf("layers %d-%d", s.FirstLayer, s.EndLayer-1)
	if s.EndLayer-s.FirstLayer == 1 {
		w = fmt.Sprintf("layer %d", s.FirstLayer)
	}
	if s.Embed {
		w = "embedding, " + w
	}
	if s.Head {
		w += ", norm, LM head"
	}
	return w
}

// TeacherPlan is a teacher laid out over GPUs.
type TeacherPlan struct {
	Opts    PlanOptions
	Stages  []StagePlan
	Reserve int64 // kept free on each GPU (pool rounding, libraries)
	// Budget is the token budget of the whole teacher: the smallest of
	// its stages' (0: the weights alone do not fit some GPU).
	Budget int
	cfg    *model.Config
}

// PlanTeacher lays a model of cfg out over the GPUs of o.
func PlanTeacher(cfg *model.Config, o PlanOptions) (TeacherPlan, error) {
	if len(o.Devices) > 0 {
		o.GPUs = len(o.Devices)
	}
	if o.GPUs < 1 {
		return TeacherPlan{}, errkind.Errorf(ErrPlan, "%d GPUs: want at least 1", o.GPUs)
	}
	if len(o.Devices) == 0 {
		for i := 0; i < o.GPUs; i++ {
			o.Devices = append(o.Devices, i)
		}
	}
	// Stages sharing a GPU (--devices 0,0: a pipeline tried on one GPU)
	// share its memory, which a plan of a GPU a stage does not model: it
	// planned each of them as if it had the whole GPU.
	seen := map[int]bool{}
	for _, d := range o.Devices {
		if seen[d] {
			return TeacherPlan{}, errkind.Errorf(ErrPlan, "devices %v name GPU %d twice: the plan gives every stage a GPU of its own; name distinct GPUs (or a count)", o.Devices, d)
		}
		seen[d] = true
	}
	if o.Weights == "" {
		o.Weights = WeightsBF16
	}
	if o.Weights != WeightsBF16 && o.Weights != WeightsFP8 {
		return TeacherPlan{}, errkind.Errorf(ErrPlan, "weights %q: want bf16 or fp8", o.Weights)
	}
	// A memory no larger than the reserve plans nothing: it printed a
	// negative memory on offer ("exceed the -0.25 GiB a GPU offers").
	if r := deviceReserve(o.DeviceBytes); o.DeviceBytes <= r {
		return TeacherPlan{}, errkind.Errorf(ErrPlan, "device memory %d bytes: not more than the %d MiB each GPU keeps in reserve: give a GPU's whole memory, e.g. 80GiB", o.DeviceBytes, r>>20)
	}
	if o.MaxLen <= 0 {
		o.MaxLen = cfg.MaxPositions
	}
	o.K = max(o.K, 1)
	if o.GPUs > cfg.Layers {
		return TeacherPlan{}, errkind.Errorf(ErrPlan, "%d GPUs for %d layers: at most %d stages (one layer each)", o.GPUs, cfg.Layers, cfg.Layers)
	}
	p := TeacherPlan{Opts: o, Reserve: deviceReserve(o.DeviceBytes), cfg: cfg, Stages: SplitLayers(cfg, o.GPUs, o.Weights)}
	p.Budget = -1
	for i := range p.Stages {
		st := &p.Stages[i]
		st.Device = o.Devices[i]
		avail := o.DeviceBytes - p.Reserve - st.WeightBytes
		need := func(n int) int64 { return p.StageBytes(i, n).Total() }
		st.Budget = largestFitting(need, avail)
		st.Bytes = p.StageBytes(i, max(st.Budget, 1))
		if p.Budget < 0 || st.Budget < p.Budget {
			p.Budget = st.Budget
		}
	}
	return p, nil
}

// largestFitting is the largest n >= 1 with need(n) <= avail (need grows
// with n), or 0 when need(1) does not fit.
func largestFitting(need func(int) int64, avail int64) int {
	if need(1) > avail {
		return 0
	}
	lo, hi := 1, 1<<24
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
	return lo
}

// StageBytes is stage i's bytes beside its weights for a forward of n
// tokens (samples of at most the plan's MaxLen), by term.
func (p TeacherPlan) StageBytes(i, n int) StageBytes {
	st := p.Stages[i]
	return stageBytes(p.cfg, compute.BF16, n, min(n, p.Opts.MaxLen), p.Opts.K, p.Opts.Draws, st.Head, p.Opts.Weights == WeightsFP8, p.Opts.Scratch)
}

// stageBytes is a stage's bytes beside its weights for a forward of n
// tokens, samples of at most maxLen, top-k k and draws a position, with
// activations of act and (fp8) FP8 Linear weights: the plan's arithmetic
// and, with a device's scratch, CheckDeviceFit's (Model.StageDeviceBytes).
func stageBytes(cfg *model.Config, act compute.DType, n, maxLen, k, draws int, head, fp8 bool, scratch func(compute.ForwardShape) (int64, int64)) StageBytes {
	var b StageBytes
	if !head {
		k, draws = 0, 0
		b.Handoff = int64(4+act.Size()) * int64(n) * int64(cfg.Hidden)
	}
	b.Activations = decoder.ActivationBytesOf(cfg, n, k, act)
	if draws > 0 { // the uniforms (two I32 a draw), the drawn ids, the tail mass
		b.Draws = int64(n) * (12*int64(draws) + 4)
	}
	if scratch != nil {
		s := compute.ForwardShape{Tokens: n, MaxLen: maxLen, K: k, Draws: draws, Hidden: cfg.Hidden, Heads: cfg.Heads, KVHeads: cfg.KVHeads,
			HeadDim: cfg.HeadDim, Intermediate: cfg.Intermediate, Vocab: cfg.VocabSize, NoHead: !head, FP8: fp8}
		if cfg.NumExperts > 0 {
			s.Experts, s.TopK, s.MoEIntermediate = cfg.NumExperts, cfg.ExpertsPerTok, cfg.MoEIntermediate
		}
		b.Workspace, b.LMHead = scratch(s)
	}
	return b
}

// Check reports whether every GPU holds a forward of budget tokens (0:
// one token), with an error naming the first GPU that does not and what
// to change.
func (p TeacherPlan) Check(budget int) error {
	budget = max(budget, 1)
	gib := func(b int64) string { return fmt.Sprintf("%.2f GiB", float64(b)/(1<<30)) }
	for i, st := range p.Stages {
		left := p.Opts.DeviceBytes - p.Reserve - st.WeightBytes
		who := fmt.Sprintf("GPU %d (%s)", st.Device, st.What())
		if left < 0 {
			return fmt.Errorf("%w: %s: its %s weights exceed the %s a GPU offers (%s of its memory, %s kept in reserve) by %s: spread the layers over more GPUs (--devices), use GPUs with more memory, or fp8 weights",
				ErrDeviceMemory, who, gib(st.WeightBytes), gib(p.Opts.DeviceBytes-p.Reserve), gib(p.Opts.DeviceBytes), gib(p.Reserve), gib(-left))
		}
		if need := p.StageBytes(i, budget).Total(); need > left {
			fix := "spread the layers over more GPUs (--devices), or use GPUs with more memory"
			if p.Budget > 0 {
				fix = fmt.Sprintf("lower --token-budget to %d or less (the largest forward every GPU holds), or %s", p.Budget, fix)
			}
			return fmt.Errorf("%w: %s: a forward of %d tokens needs %s beside its %s of weights, but %s are left: %s",
				ErrDeviceMemory, who, budget, gib(need), gib(st.WeightBytes), gib(left), fix)
		}
	}
	return nil
}

// SplitLayers cuts cfg's decoder layers into g contiguous stages
// (g <= the layers), balanced by the bytes of their weights in format w:
// the embedding with the first stage, the final norm and LM head with the
// last, and the largest stage the smallest any such split can have. Each
// stage but the last also holds a copy of the next stage's first input
// norm (its last layer's residual add is fused with that norm); with tied
// embeddings and more than one stage, the last holds a copy of the
// embedding as its LM head. A pipelined teacher loads this split.
func SplitLayers(cfg *model.Config, g int, w WeightFormat) []StagePlan {
	embed, layers, head, norms := weightBytes(cfg, w)
	tiedCopy := int64(0)
	if cfg.TieEmbeddings && g > 1 {
		tiedCopy = embed
	}
	st := splitLayers(embed, layers, head+tiedCopy, g)
	for i := range st {
		if i+1 < len(st) {
			c := norms[st[i].EndLayer]
			st[i].WeightBytes += c
			st[i].CopyBytes += c
		}
	}
	st[len(st)-1].CopyBytes += tiedCopy
	return st
}

// weightBytes are the bytes of the embedding, of each layer and of the
// final norm and LM head (no copy of a tied embedding), and of each
// layer's input norm, in format w.
func weightBytes(cfg *model.Config, w WeightFormat) (embed int64, layers []int64, head int64, inNorms []int64) {
	layers, inNorms = make([]int64, cfg.Layers), make([]int64, cfg.Layers)
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
		case strings.HasPrefix(t.Name, "model.layers."):
			rest := strings.TrimPrefix(t.Name, "model.layers.")
			i, _ := strconv.Atoi(rest[:strings.IndexByte(rest, '.')])
			layers[i] += b
			if strings.HasSuffix(t.Name, ".input_layernorm.weight") {
				inNorms[i] = b
			}
		default: // model.norm.weight, lm_head.weight
			head += b
		}
	}
	return embed, layers, head, inNorms
}

// splitLayers cuts the layers into g contiguous stages (g <= len(layers)),
// the embedding with the first and the head with the last, minimizing the
// largest stage's bytes: the smallest cap for which a greedy fill from
// the first layer makes at most g stages, then stages of several layers
// cut in two (never raising the largest) until there are g.
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
	st := fill(lo)
	for len(st) < g && len(st) < len(layers) {
		// Cut the stage of the most layers after its first layer: both
		// halves hold less than it did.
		j := 0
		for i := range st {
			if st[i].EndLayer-st[i].FirstLayer > st[j].EndLayer-st[j].FirstLayer {
				j = i
			}
		}
		a, b := st[j], st[j]
		a.EndLayer, a.Head = a.FirstLayer+1, false
		b.FirstLayer, b.Embed = a.EndLayer, false
		a.WeightBytes = layers[a.FirstLayer]
		if a.Embed {
			a.WeightBytes += embed
		}
		b.WeightBytes = st[j].WeightBytes - a.WeightBytes
		st = append(st[:j], append([]StagePlan{a, b}, st[j+1:]...)...)
	}
	return st
}

// LoadConfigAt reads a config.json, or the one in a checkpoint directory.
func LoadConfigAt(path string) (*model.Config, error) {
	dir := path
	if st, err := os.Stat(path); err != nil || !st.IsDir() {
		if filepath.Base(path) != "config.json" {
			if errors.Is(err, fs.ErrNotExist) {
				// A mistyped path was answered as if it were a file of the
				// wrong kind ("want a config.json"), never saying that
				// nothing is there.
				return nil, errkind.Errorf(ErrPlan, "%s does not exist: check the path (want a config.json or the checkpoint directory holding one)", path)
			}
			return nil, errkind.Errorf(ErrPlan, "%s: want a config.json or the directory holding one", path)
		}
		dir = filepath.Dir(path) // model.LoadConfig reads DIR/config.json
	}
	return model.LoadConfig(dir)
}
