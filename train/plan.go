package train

import (
	"fmt"
	"strings"

	"distill/compute"
	"distill/model"
	"distill/model/decoder"
)

// The training memory plan: what a student's training step holds on a
// device backend (compute.DeviceMemory, the CUDA backend), term by term,
// from the model's config and the batch's shape alone, so that it can be
// computed without a device (`student plan`) and checked before step 1
// (the trainer refuses a configuration that does not fit, naming what
// does, instead of failing with an out-of-memory error mid-run).
//
// The terms follow what the code allocates:
//
//   - run-long (allocated once): the fp32 parameters (train.Student's
//     arena), their fp32 gradients, AdamW's fp32 moments m and v
//     (optim.NewAdamW), the CUDA backend's BF16 shadows of the GEMM
//     weights (half of each; under QAD also of the fake-quantized
//     weights), and under NVFP4 QAD the fp32 fake-quantized weights
//     (decoder.Model's QAD arena);
//   - per row (one packed row of up to data.seq_len tokens is one
//     forward and backward): the decoder's activation arena under the
//     recompute mode (decoder.TrainActivationBytes, exact: it is the
//     arena's own layout function), and the largest scratch one kernel
//     call takes beside it (each call frees its own before the next one
//     allocates): the attention backward's BF16 copies and workspace, the
//     loss head's logit tiles, the GEMM backward's BF16 operands, an MoE
//     layer's grouped activations.
//
// The kernel scratch terms bound what compute/cuda's kernels allocate
// (compute/cuda: cudnn.go, train.go, train_moe.go); TestTrainPlanPeak in
// compute/cuda holds the plan to within 2x of the emulator's measured
// peak, per dominant term, so that the two cannot drift apart unseen.

// PlanShape is what a training step's memory depends on.
type PlanShape struct {
	Model *model.Config
	// RowTokens is the longest row (data.seq_len): one forward and
	// backward holds one row.
	RowTokens int
	// K is the width of the teachers' top-k at a position (the union of
	// several teachers' ids: at most the sum of their k); 0 for SFT.
	K int
	// QAD: NVFP4 quantization-aware training.
	QAD bool
	// Recompute is the activation recomputation mode.
	Recompute decoder.Recompute
	// Activations is the backend's activation dtype (compute.Backend's
	// ActDType): compute.BF16 on the CUDA backend by default; the zero
	// value is compute.F32.
	Activations compute.DType
	// AttnWorkspace is what the attention library asks for beside the
	// tensors for one row of RowTokens tokens, as the backend reports it
	// (compute.AttentionWorkspaceReporter: cuDNN's plans); 0 plans it as
	// an fp32 copy of q, which cuDNN's deterministic backward exceeds
	// (on an H200 with cuDNN 9.19, about 2 KiB per token and query head
	// at rows of 1024 tokens and more).
	AttnWorkspace int64
	// Ranks and ZeRO are a data-parallel run's size and ZeRO stage (0 or
	// 1 ranks: one process). Stage 1 shards AdamW's moments over the
	// ranks; stages 2 and 3 lay the student out as Sharding says (each
	// rank its part of every unit's master weights, gradients and
	// moments, the whole gradients of one block and of the units outside
	// the blocks; stage 2 every unit's whole weights, stage 3 those of two
	// blocks and of the units outside them, the embedding's and the LM
	// head's sharing one buffer for weights and one for gradients).
	// Sharded, the GEMMs round their fp32 weights per use (no BF16 copies
	// are kept), except without QAD, where the blocks' whole weights
	// (stage 2's, stage 3's slots) are BF16 (Sharding's BF16 gathers; and
	// the blocks' norms, biases and routers are whole in fp32, with the
	// pack that refreshes them).
	Ranks, ZeRO int
	// Overlap plans Sharding.Overlap at stages 2 and 3: a second block's
	// whole gradients, and at stage 3 a third block's weights (and under
	// QAD its fake-quantized copy); at stages 0 and 1 over several ranks,
	// two blocks' gradients in their all-reduce buckets
	// (Student.ReduceInBackward).
	Overlap bool
	// LoRA, when set, plans a LoRA student (train.NewLoRAStudentOn): the
	// frozen base once in the activation dtype, the adapters' fp32
	// weights, gradients, moments and BF16 copies, the norms' discarded
	// gradient, and the adapters' scratch per row. QAD is then
	// off (an NVFP4 base is quantized in place). ZeRO 0 or 1 only.
	LoRA *LoRAConfig
	// KeepLogits plans the loss head keeping a row's logits between its
	// passes (Student.SetKeepLogits): fp32, 4·RowTokens·V bytes in place
	// of the logit tile.
	KeepLogits bool
}

// KeepLogitsFit is the plan of sh with the loss head keeping its logits
// (KeepLogits) and whether it fits budget bytes: the trainer's check
// before step 1, `student plan` and the training benchmark keep them
// where it does, beside the recompute mode already chosen.
func KeepLogitsFit(sh PlanShape, budget int64) (total int64, fits bool) {
	sh.KeepLogits = true
	total = PlanMemory(sh).Total()
	return total, total <= budget
}

// PlanTerm is one line of a memory plan.
type PlanTerm struct {
	Name  string
	Bytes int64
	// PerRow: the term grows with the row (activations, scratch);
	// otherwise it is the run's (parameters, optimizer state).
	PerRow bool
	// Scratch: one of the kernel scratch terms, of which only the largest
	// counts in Total (each call frees its scratch before the next).
	Scratch bool
}

// MemoryPlan is a training step's device memory, term by term.
type MemoryPlan struct {
	Shape PlanShape
	Terms []PlanTerm
}

// Total is the step's peak: every run-long and per-row term, and the
// largest scratch term.
func (p MemoryPlan) Total() int64 {
	var t, s int64
	for _, x := range p.Terms {
		if x.Scratch {
			s = max(s, x.Bytes)
		} else {
			t += x.Bytes
		}
	}
	return t + s
}

// Term returns the bytes of the term named name (0 if none).
func (p MemoryPlan) Term(name string) int64 {
	for _, x := range p.Terms {
		if x.Name == name {
			return x.Bytes
		}
	}
	return 0
}

// The names of the plan's terms.
const (
	TermParams      = "parameters (fp32)"
	TermGrads       = "gradients (fp32)"
	TermMoments     = "AdamW moments (fp32 m, v)"
	TermShadows     = "BF16 weight copies"
	TermQAD         = "NVFP4 fake-quantized weights (fp32)"
	TermActivations = "activations"
	TermBatch       = "batch (token ids, sample starts)"
	TermAttention   = "attention scratch"
	TermLossHead    = "loss head tiles"
	TermGEMM        = "GEMM operand scratch"
	TermMoE         = "MoE layer scratch"
	TermLoRABase    = "frozen LoRA base"
	TermLoRAScratch = "LoRA adapters' scratch"
)

// planCounts are the parameter counts the plan needs.
type planCounts struct {
	all, gemm, linear int64 // every tensor; GEMM operands; QAD's Linears
	largestLinear     int64
	largestGEMM       int64 // the largest GEMM operand (the LM head's included)
	largestLayer      int64 // a decoder layer's GEMM operands, the most of any layer
	// Sharding's units (Sharding): the tensors of each decoder layer,
	// and the runs of tensors outside the layers.
	layerAll    []int64 // each layer's tensors
	layerLinear []int64 // each layer's QAD Linears
	// layerSmall are each layer's tensors other than GEMM weights (the
	// ones BF16 gathers keep whole in fp32: gemmWeight), as ranges of the
	// layer's unit; misaligned: a GEMM weight does not start a multiple
	// of 8 elements into its layer (BF16 gathers then stay fp32).
	layerSmall [][][2]int64
	misaligned bool
	outside    []int64 // the units outside the layers
	outsideBig []bool  // outside[i] holds the embedding table or the LM head (stage 3 gathers it when used)
}

// parts is a rank's part of every unit over n ranks: sum of ceil(u/n).
func (c planCounts) parts(n int64) int64 {
	var p int64
	for _, u := range append(append([]int64{}, c.layerAll...), c.outside...) {
		p += (u + n - 1) / n
	}
	return p
}

// smallPack is what BF16 gathers (Sharding) keep of the layers' small
// tensors: their elements (whole, on every rank) and the pack a rank
// gathers them through (the most elements of them any rank's parts
// hold), over n ranks.
func (c planCounts) smallPack(n int64) (whole, pack int64) {
	mine := make([]int64, n)
	for li, ss := range c.layerSmall {
		per := (c.layerAll[li] + n - 1) / n
		for _, x := range ss {
			whole += x[1]
			for r := range n {
				if a, b := max(x[0], r*per), min(x[0]+x[1], (r+1)*per); a < b {
					mine[r] += b - a
				}
			}
		}
	}
	for _, m := range mine {
		pack = max(pack, m)
	}
	return whole, pack
}

// padded is the largest whole (padded: n·ceil(u/n)) of the layer units
// of us.
func padded(us []int64, n int64) int64 {
	var m int64
	for _, u := range us {
		m = max(m, (u+n-1)/n*n)
	}
	return m
}

func countParams(cfg *model.Config) planCounts {
	var c planCounts
	var layer []int64 // each layer's GEMM operands
	lastOutside := false
	for _, t := range cfg.Tensors() {
		n := int64(1)
		for _, d := range t.Shape {
			n *= int64(d)
		}
		c.all += n
		li := blockOf(t.Name)
		if li >= 0 {
			for len(c.layerAll) <= li {
				c.layerAll, c.layerLinear, c.layerSmall = append(c.layerAll, 0), append(c.layerLinear, 0), append(c.layerSmall, nil)
			}
			if !gemmWeight(t.Name) {
				c.layerSmall[li] = append(c.layerSmall[li], [2]int64{c.layerAll[li], n})
			} else if c.layerAll[li]%8 != 0 {
				c.misaligned = true
			}
			c.layerAll[li] += n
			if !t.Norm && !t.Bias && len(t.Shape) == 2 && !isRouter(t.Name) {
				c.layerLinear[li] += n
			}
		} else if prev := len(c.outside) - 1; prev >= 0 && lastOutside {
			c.outside[prev] += n
		} else {
			c.outside, c.outsideBig = append(c.outside, n), append(c.outsideBig, false)
		}
		if li < 0 && (t.Name == "model.embed_tokens.weight" || t.Name == "lm_head.weight") {
			c.outsideBig[len(c.outsideBig)-1] = true
		}
		lastOutside = li < 0
		if t.Norm || t.Bias || len(t.Shape) != 2 {
			continue
		}
		if li >= 0 {
			for len(layer) <= li {
				layer = append(layer, 0)
			}
			layer[li] += n
		}
		if t.Name != "model.embed_tokens.weight" || cfg.TieEmbeddings {
			c.largestGEMM = max(c.largestGEMM, n)
		}
		switch {
		case t.Name == "model.embed_tokens.weight" && !cfg.TieEmbeddings:
			// A lookup table, not a GEMM operand.
		case t.Name == "model.embed_tokens.weight" || t.Name == "lm_head.weight":
			c.gemm += n
		default:
			c.gemm += n
			if !isRouter(t.Name) {
				c.linear += n
				c.largestLinear = max(c.largestLinear, n)
			}
		}
	}
	for _, b := range layer {
		c.largestLayer = max(c.largestLayer, b)
	}
	return c
}

// isRouter reports whether name is an MoE router (mlp.gate.weight, not
// quantized; the experts' are mlp.experts.E.gate_proj).
func isRouter(name string) bool {
	const s = ".mlp.gate.weight"
	return len(name) > len(s) && name[len(name)-len(s):] == s
}

// PlanMemory is the training memory plan of s: the run-long state of the
// student's layout (LoRA, sharded at ZeRO 2 and 3, or whole on every
// rank), then a row's activations, then each kernel's scratch. The terms'
// order is the printed plan's (`student plan`).
func PlanMemory(s PlanShape) MemoryPlan {
	if s.LoRA != nil {
		s.QAD = false // an NVFP4 base is quantized in place, not fake-quantized per step
	}
	p := &MemoryPlan{Shape: s}
	c := countParams(s.Model)
	var perUse int64 // a GEMM weight rounded to BF16 per use (sharded)
	switch {
	case s.LoRA != nil:
		p.addLoRAState(s)
	case s.ZeRO >= 2:
		perUse = p.addShardedState(s, c)
	default:
		p.addReplicatedState(s, c)
	}
	p.addActivations(s)
	p.addAttentionScratch(s)
	p.addLossHeadScratch(s)
	p.addGEMMScratch(s, perUse)
	p.addMoEScratch(s)
	return *p
}

// addRunLong appends a term allocated once for the run.
func (p *MemoryPlan) addRunLong(name string, b int64) {
	p.Terms = append(p.Terms, PlanTerm{Name: name, Bytes: b})
}

// addPerRow appends a term that grows with the row and stays allocated
// across the row's kernels (it adds to the others).
func (p *MemoryPlan) addPerRow(name string, b int64) {
	p.Terms = append(p.Terms, PlanTerm{Name: name, Bytes: b, PerRow: true})
}

// addScratch appends a kernel's per-row scratch: the kernels run one at
// a time and free theirs, so only the largest counts (Total).
func (p *MemoryPlan) addScratch(name string, b int64) {
	p.Terms = append(p.Terms, PlanTerm{Name: name, Bytes: b, PerRow: true, Scratch: true})
}

// planRanks is the number of data-parallel ranks s shards over: at least
// one (Ranks 0 is one process).
func planRanks(s PlanShape) int64 { return int64(max(s.Ranks, 1)) }

// planRowTokens is the row's length, at least one token: a plan of an
// empty row is a plan of one token's.
func planRowTokens(s PlanShape) int64 { return int64(max(s.RowTokens, 1)) }

// momentsShare is what a rank holds of AdamW's moments of b bytes: its
// share from ZeRO stage 1 on (the moments are the first state sharded),
// else all of them.
func momentsShare(s PlanShape, b int64) int64 {
	if n := planRanks(s); s.ZeRO >= 1 {
		return (b + n - 1) / n
	}
	return b
}

// addLoRAState appends a LoRA student's state (train.NewLoRAStudentOn):
// the frozen base once in the activation dtype, and only the adapters
// trained, so the fp32 parameters, gradients, moments and BF16 copies are
// the adapters'. The adapters' per-row scratch is planned here too, as
// the LoRA layout's own term.
func (p *MemoryPlan) addLoRAState(s PlanShape) {
	cfg := s.Model
	base, adapters, onExperts, rank, out, dropIn := loraCounts(cfg, s.LoRA)
	p.addRunLong(TermLoRABase, int64(s.Activations.Size())*base)
	p.addRunLong(TermParams, 4*adapters)
	// The adapters' gradients and the norms' discard (the frozen LM
	// head gets none: LossHeadBackward's nil dw).
	p.addRunLong(TermGrads, 4*adapters+4*int64(max(cfg.Hidden, cfg.HeadDim)))
	p.addRunLong(TermMoments, momentsShare(s, 8*adapters))
	// The experts' adapters run in fp32 kernels inside the MoE block
	// (compute/cuda's moe_lora.go): nothing reads them in BF16.
	p.addRunLong(TermShadows, 2*(adapters-onExperts))
	p.addPerRow(TermLoRAScratch, decoder.LoRAScratchBytes(int(planRowTokens(s)), rank, out, dropIn, s.Activations))
}

// addShardedState appends ZeRO stage 2's or 3's state, Sharding's
// layout: a rank's parts of every unit (master weights, gradients,
// moments), one block's whole gradients (two with overlap) and those of
// the units outside the blocks, and the whole weights of every unit
// (stage 2) or of two blocks (three with overlap) and the units outside
// (stage 3), in BF16 under BF16 gathers, which at stage 3 also keep the
// rank's parts of the blocks in BF16. It returns the bytes of the largest GEMM weight rounded to
// BF16 for one use, which the GEMM scratch holds: sharded, the GEMMs
// round their fp32 weights per use rather than keep BF16 copies (but for
// the BF16 gathers' layers, counted here).
func (p *MemoryPlan) addShardedState(s PlanShape, c planCounts) (perUse int64) {
	n := planRanks(s)
	parts, block := c.parts(n), padded(c.layerAll, n)
	slots, gradBufs := int64(2), int64(1) // stage 3's weight slots, the blocks' gradient buffers
	if s.Overlap {
		slots, gradBufs = 3, 2
	}
	outside := shardedOutside(c, n, s.ZeRO)
	layers := shardedLayers(c, n, s.ZeRO, slots)
	whole := outside
	var copies int64 // BF16 gathers: the layers' whole weights
	if !s.QAD && !c.misaligned {
		small, pack := c.smallPack(n)
		whole += small + (n+1)*pack
		copies = 2 * layers
		if s.ZeRO == 3 { // and the rank's parts of the blocks, kept rounded (shards.bfPart)
			for _, u := range c.layerAll {
				copies += 2 * ((u + n - 1) / n)
			}
		}
	} else {
		whole += layers
	}
	p.addRunLong(TermParams, 4*(whole+parts))
	// The reduce-scatter's landing: the largest part.
	landing := (padded(append(append([]int64{}, c.layerAll...), c.outside...), 1) + n - 1) / n
	p.addRunLong(TermGrads, 4*(parts+outside+gradBufs*block+landing))
	p.addRunLong(TermMoments, 8*parts)
	if s.QAD {
		// Stage 2 fake-quantizes every Linear; stage 3 only the slots'
		// layers' (the largest layer's, a slot each).
		q := 4 * c.linear
		if s.ZeRO == 3 {
			q = slots * 4 * padded(c.layerLinear, 1)
		}
		p.addRunLong(TermQAD, q)
	}
	p.addRunLong(TermShadows, copies)
	return 2 * c.largestGEMM
}

// shardedOutside is the elements of the whole (padded over n ranks) units
// outside the blocks, which every rank holds at ZeRO 2 and 3; at stage 3
// the embedding's and the LM head's units share one buffer, the larger's.
func shardedOutside(c planCounts, n int64, zero int) int64 {
	var outside, big int64
	for i, u := range c.outside {
		w := (u + n - 1) / n * n
		if zero == 3 && c.outsideBig[i] {
			big = max(big, w)
			continue
		}
		outside += w
	}
	return outside + big
}

// shardedLayers is the elements of the blocks' whole (padded) weights a
// rank holds: every block's at stage 2, slots blocks' (the largest's) at
// stage 3.
func shardedLayers(c planCounts, n int64, zero int, slots int64) int64 {
	if zero != 2 {
		return slots * padded(c.layerAll, n)
	}
	var layers int64
	for _, u := range c.layerAll {
		layers += (u + n - 1) / n * n
	}
	return layers
}

// addReplicatedState appends ZeRO stage 0's or 1's state, whole on every
// rank: the fp32 parameters and gradients (and, data parallel with
// overlap, two layers' gradients on their way in the all-reduce buckets,
// train.dpBuckets), AdamW's moments (a rank's share at stage 1), under
// QAD the fp32 fake-quantized Linears, and the CUDA backend's BF16 copies
// of every GEMM weight (under QAD of the fake-quantized ones too).
func (p *MemoryPlan) addReplicatedState(s PlanShape, c planCounts) {
	p.addRunLong(TermParams, 4*c.all)
	var buckets int64
	if s.Overlap && s.Ranks > 1 {
		buckets = 2 * padded(c.layerAll, 1)
	}
	p.addRunLong(TermGrads, 4*(c.all+buckets))
	p.addRunLong(TermMoments, momentsShare(s, 8*c.all))
	copies := 2 * c.gemm
	if s.QAD {
		copies += 2 * c.linear
		p.addRunLong(TermQAD, 4*c.linear)
	}
	p.addRunLong(TermShadows, copies)
}

// addActivations appends what one row holds across its forward and
// backward: the decoder's activation arena under the recompute mode
// (decoder.TrainActivationBytesLoRA, exact: the arena's own layout
// function) and the batch's token ids and sample starts.
func (p *MemoryPlan) addActivations(s PlanShape) {
	T := planRowTokens(s)
	p.addPerRow(TermActivations, decoder.TrainActivationBytesLoRA(s.Model, int(T), s.Recompute, s.QAD, s.Activations, loraOnOProj(s.Model, s.LoRA)))
	p.addPerRow(TermBatch, 4*(2*T+1))
}

// addAttentionScratch appends attention's backward scratch (the larger
// half): BF16 copies of dout and, under fp32 activations, of q, k, v and
// o; the BF16 gradients dq, dk, dv; the softmax sums, an aligned copy of
// the statistics, cuDNN's per-sample metadata and its workspace: the
// backend's figure (AttnWorkspace), else planned as an fp32 dq.
func (p *MemoryPlan) addAttentionScratch(s PlanShape) {
	cfg := s.Model
	T := planRowTokens(s)
	H, KV, D := int64(cfg.Heads), int64(cfg.KVHeads), int64(cfg.HeadDim)
	nq, nk := T*H*D, T*KV*D
	copies := 2 * (nq + nq + 2*nk) // dout; dq, dk, dv
	if s.Activations != compute.BF16 {
		copies += 2 * (2*nq + 2*nk) // q, o; k, v
	}
	ws := attnWorkspaceEstimate(T, H, KV, D)
	if s.AttnWorkspace > 0 {
		ws = s.AttnWorkspace
	}
	p.addScratch(TermAttention, copies+2*4*T*H+ws+64<<10)
}

// addLossHeadScratch appends the loss head's backward scratch over the
// M <= T counted positions: the rows' BF16 copy, the logit tile (fp32)
// and its BF16 gradient, the fp32 dx of the rows, the host's uploads
// (rows, labels, teacher ids, coefficients) and, where the device
// computes the coefficients (compute.DeviceLossCoef), the teacher's
// log-probs and rank columns and the positions' loss values (two
// float64). Kept logits (KeepLogits) are every tile's fp32 logits at
// once.
func (p *MemoryPlan) addLossHeadScratch(s PlanShape) {
	T := planRowTokens(s)
	C, V, K := int64(s.Model.Hidden), int64(s.Model.VocabSize), int64(s.K)
	vt := min(V, max(lossTileBudget/(4*T)/64*64, 64))
	logits := 4 * T * vt
	if s.KeepLogits {
		logits = 4 * T * V
	}
	p.addScratch(TermLossHead, 2*T*C+logits+2*T*vt+4*T*C+4*T*(9+4*K)+64<<10)
}

// addGEMMScratch appends a GEMM's backward scratch: BF16 copies of dout
// and x (the MLP's down: dout (T, C), x (T, I)) and, sharded, the weight
// rounded to BF16 for this use (perUse). It bounds RMSNorm's backward's
// scratch too, dw's float64 partials (compute/cuda's rmsDWGroup and
// colChunk): at most ceil(rows/16) rows of dim, so T·C/2 + 8·C bytes for
// the hidden norms and T·H·D/2 + 8·D for the q/k norms, both below this
// term, at least 2·T·(C + max(H·D, C)), from 3 tokens on.
func (p *MemoryPlan) addGEMMScratch(s PlanShape, perUse int64) {
	cfg := s.Model
	T := planRowTokens(s)
	C, H, D, I := int64(cfg.Hidden), int64(cfg.Heads), int64(cfg.HeadDim), int64(cfg.Intermediate)
	p.addScratch(TermGEMM, 2*T*(C+max(I, H*D, C))+perUse)
}

// addMoEScratch appends an MoE layer's scratch, for an MoE student only:
// its grouped activations over the T·k routed rows (and under QAD their
// fake-quantized inputs; with LoRA on the experts, the adapters' grouped
// scratch).
func (p *MemoryPlan) addMoEScratch(s PlanShape) {
	cfg := s.Model
	if cfg.NumExperts == 0 {
		return
	}
	T := planRowTokens(s)
	C := int64(cfg.Hidden)
	E, KE, IM := int64(cfg.NumExperts), int64(cfg.ExpertsPerTok), int64(cfg.MoEIntermediate)
	P := T * KE
	b := P*(8*C+10*IM+8) + 4*T*E
	if s.QAD {
		b += 4*T*C + 4*P*IM
	}
	if s.LoRA != nil && loraOnExperts(cfg, s.LoRA) {
		// The experts' adapters' scratch (compute/cuda's moe_lora.go:
		// grouped kernels over every expert's rows at once): t and dt
		// (fp32, rank wide) of the grouped rows, and the experts'
		// table (8 words an expert).
		b += 8*P*int64(s.LoRA.Rank) + 64*E
	}
	p.addScratch(TermMoE, b+64<<10)
}

// ExpertParallelSaving is what expert parallelism over s.Ranks ranks
// (each rank holding 1/Ranks of every MoE layer's experts whole, and the
// tokens sent to their experts' ranks; not built) would save a GPU
// against the data-parallel layout s plans: the bytes of the experts'
// weights that the layout holds beyond a rank's own share. 0 for a dense
// student or one process.
//
//   - ZeRO 0 and 1: every rank holds every expert's fp32 weights,
//     gradients and BF16 copies (10 bytes a parameter) and, at stage 0,
//     its moments (8): EP keeps 1/N of them (all 18 bytes of its own).
//   - ZeRO 2: the parts (master, gradients, moments) are already 1/N, but
//     every rank holds every expert's whole weights (2 bytes: BF16; 4
//     under QAD) and one layer's whole gradients (two with overlap); EP
//     keeps its own experts whole in its master and needs neither.
//   - ZeRO 3: the two weight slots and the gradient buffer hold a whole
//     layer's experts (8 bytes a parameter of the largest layer's: BF16
//     slots, an fp32 buffer; with overlap three slots and two buffers,
//     14; under QAD the slots are fp32: 12 and 20); EP gathers no expert
//     (under QAD it keeps its own experts' fake-quantized twins instead
//     of the slots' layers').
//
// EP also replaces the all-gathers of the experts' weights (stage 3: each
// layer's, twice a row) with all-to-alls of the routed tokens'
// activations; that traffic is not in a memory plan.
func ExpertParallelSaving(s PlanShape) int64 {
	cfg := s.Model
	n := int64(s.Ranks)
	if cfg.NumExperts == 0 || n <= 1 || s.LoRA != nil {
		return 0
	}
	var all, largest int64 // the experts' parameters: all layers', the largest layer's
	layer := map[int]int64{}
	for _, t := range cfg.Tensors() {
		if li := blockOf(t.Name); li >= 0 && isExpert(t.Name) {
			v := int64(1)
			for _, d := range t.Shape {
				v *= int64(d)
			}
			all += v
			layer[li] += v
		}
	}
	for _, v := range layer {
		largest = max(largest, v)
	}
	own := (all + n - 1) / n
	slots, grads := int64(2), int64(1) // stage 3's weight slots, the blocks' gradient buffers (Sharding)
	if s.Overlap {
		slots, grads = 3, 2
	}
	// Under QAD each copy of an expert's weights has its fake-quantized
	// fp32 twin (and, unsharded, that twin's BF16 copy).
	switch q := map[bool]int64{true: 1}[s.QAD]; s.ZeRO {
	case 0:
		return (18 + 6*q) * (all - own)
	case 1:
		return (10 + 6*q) * (all - own)
	case 2:
		if !s.QAD && !countParams(cfg).misaligned { // BF16 whole weights
			return 2*all + 4*grads*largest
		}
		return 4*all + 4*grads*largest + 4*q*(all-own)
	default: // (its own experts' fake-quantized twins stay, run-long)
		if !s.QAD && !countParams(cfg).misaligned { // BF16 slots
			return (2*slots + 4*grads) * largest
		}
		return 4*(slots+grads)*largest + q*(4*slots*largest-4*own)
	}
}

// isExpert reports whether name is a routed expert's tensor
// (model.layers.N.mlp.experts.E.*).
func isExpert(name string) bool { return strings.Contains(name, ".mlp.experts.") }

// attnWorkspaceEstimate is cuDNN's workspace for the attention backward of
// a row of T tokens (one sample: its bucket, the decoder cuts packed rows
// to fit it) without a device to ask: what cuDNN 9.19's deterministic
// backward asked for on an H200, 2 bytes per query head and pair of
// positions of the bucket, s = pow2(T), plus an fp32 dq-sized term under
// GQA (2112 MiB at s 8192 with 16/8 heads of 128; 589,824 at s 256 with
// 4/2 of 16, against 590,592 measured; 64 MiB at 16 samples of 1024
// with 2/2 heads of 64). The trainer's check asks the backend instead.
func attnWorkspaceEstimate(T, H, KV, D int64) int64 {
	s := int64(1)
	for s < T {
		s *= 2
	}
	ws := 2 * s * s * H
	if KV != H {
		ws += 4 * s * H * D
	}
	return ws
}

// loraOnExperts reports whether lc adapts an MoE expert of cfg.
func loraOnExperts(cfg *model.Config, lc *LoRAConfig) bool {
	for _, t := range cfg.Tensors() {
		if _, ok := lc.loraTarget(t.Name); ok && isExpert(t.Name) {
			return true
		}
	}
	return false
}

// loraOnOProj is whether lc adapts an attention o_proj of cfg (nil: no
// LoRA).
func loraOnOProj(cfg *model.Config, lc *LoRAConfig) bool {
	if lc == nil {
		return false
	}
	for _, t := range cfg.Tensors() {
		if m, ok := lc.loraTarget(t.Name); ok && m == "o_proj" {
			return true
		}
	}
	return false
}

// loraCounts are a LoRA student's element counts: its base (each tensor
// aligned as its arena aligns it), its adapters (onExperts of them on MoE
// experts), and the largest rank, adapted output width and, under
// dropout, adapted input width (the scratch's shape).
func loraCounts(cfg *model.Config, lc *LoRAConfig) (base, adapters, onExperts int64, rank, out, dropIn int) {
	for _, t := range cfg.Tensors() {
		n := int64(1)
		for _, d := range t.Shape {
			n *= int64(d)
		}
		base = (base+baseAlign-1)/baseAlign*baseAlign + n
		if _, ok := lc.loraTarget(t.Name); ok {
			adapters += int64(lc.Rank) * int64(t.Shape[0]+t.Shape[1])
			if isExpert(t.Name) {
				onExperts += int64(lc.Rank) * int64(t.Shape[0]+t.Shape[1])
			}
			rank, out = lc.Rank, max(out, t.Shape[0])
			if lc.Dropout > 0 {
				dropIn = max(dropIn, t.Shape[1])
			}
		}
	}
	return base, adapters, onExperts, rank, out, dropIn
}

// lossTileBudget is compute/cuda's bound on the loss head's logit tile.
const lossTileBudget = 256 << 20

// DeviceReserve is the device memory a plan leaves free: the pool's
// rounding and fragmentation, the CUDA context, NVRTC's and cuBLASLt's
// own allocations: 256 MiB or 2% of the device, the larger (as the
// teacher's check, infer.Model.CheckDeviceFit).
func DeviceReserve(total int64) int64 { return max(256<<20, total/50) }

// LargestRow is the longest row (tokens) whose plan's total fits in avail
// bytes, searched up to limit; 0 when not even one token fits.
func LargestRow(s PlanShape, avail int64, limit int) int {
	fits := func(n int) bool {
		s.RowTokens = n
		p := PlanMemory(s)
		return p.Total() <= avail
	}
	best := 0
	for lo, hi := 1, limit; lo <= hi; {
		mid := lo + (hi-lo)/2
		if fits(mid) {
			best, lo = mid, mid+1
		} else {
			hi = mid - 1
		}
	}
	return best
}

// HumanBytes formats bytes in GiB with two decimals, or in MiB or KiB
// below a GiB or a MiB.
func HumanBytes(b int64) string {
	switch f := float64(b); {
	case b >= 1<<30 || b <= -1<<30:
		return fmt.Sprintf("%.2f GiB", f/(1<<30))
	case b >= 1<<20 || b <= -1<<20:
		return fmt.Sprintf("%.1f MiB", f/(1<<20))
	}
	return fmt.Sprintf("%.1f KiB", float64(b)/(1<<10))
}
