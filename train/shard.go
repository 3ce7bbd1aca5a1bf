package train

import (
	"fmt"
	"os"
	"strconv"
	"strings"

	"distill/compute"
	"distill/model/decoder"
	"distill/train/optim"
)

// Sharding makes a student one rank's part of a ZeRO stage 2 or 3
// data-parallel group (DeepSpeed's stages; FSDP's SHARD_GRAD_OP and
// FULL_SHARD):
//
//   - the parameters are cut into units: one per decoder block, and the
//     runs of tensors outside the blocks (the embeddings; the final norm
//     and the LM head), each a contiguous range of the tensors in
//     model.Config.Tensors' order;
//   - each unit of n elements is padded to Size·per (per = ceil(n/Size))
//     and rank r owns its elements [r·per, (r+1)·per): the fp32 master
//     weights, the gradients and (the optimizer's groups, cut at the
//     tensors' boundaries) the AdamW moments of those elements only;
//   - a block's gradients are reduce-scattered (summed over the ranks,
//     each keeping its part) as soon as its backward has made them, out
//     of one gradient buffer all blocks share, and added to the rank's
//     part: no rank holds a whole model's gradients. At stage 2 the
//     units outside the blocks keep whole gradient buffers over a step's
//     rows and are reduce-scattered once, after the last
//     (ReduceShardGrads);
//   - stage 2: every unit keeps its whole weights, all-gathered from the
//     ranks' parts after each optimizer step (AfterStep);
//   - stage 3: the blocks' whole weights exist only while they run: two
//     buffers the blocks share in turn (block i's is i mod 2), filled by
//     an all-gather of the ranks' parts when the decoder fetches the
//     block (decoder.Residency). The units that hold the embedding
//     table or the LM head (a vocabulary by hidden matrix each) share one
//     weight buffer, gathered when the decoder fetches their role (the
//     embedding before the lookup, the LM head with the final norm before
//     the last block: it stays through the loss head), and one gradient
//     buffer, reduce-scattered a row at a time as soon as the role's
//     backward is done (decoder.Residency's FetchOutside and
//     OutsideGradsDone); a unit outside the blocks without either (a tied
//     model's final norm) stays whole.
//
// Every rank runs the same sequence of collectives: the same number of
// forwards and backwards per step (a rank without a row of its own runs
// Phantom passes), and Weights, which gathers, on every rank at once.
//
// Overlap (DeepSpeed's overlap_comm; FSDP's prefetching) runs the
// collectives beside the compute, on a backend that can
// (compute.Overlapper: the CUDA backend's second stream), ordered against
// it by events only:
//
//   - a block's reduce-scatter (and the addition of its result to the
//     rank's part, and the clearing of its whole gradients) runs while
//     the blocks before it run their backward: the blocks' whole
//     gradients alternate between two buffers (block i's is i mod 2), so
//     block i-1's backward writes one while block i's is reduced from
//     the other; block i-2's backward waits for block i's reduction (the
//     collectives run one after another, so one landing serves);
//   - at stage 3, block i+2's all-gather runs while block i's forward
//     does (decoder.Prefetcher), and block i-1's while block i's
//     backward does: three weight slots (block i's is i mod 3), as block
//     i's forward reads blocks i and i+1 (its fused residual add ends
//     with block i+1's input norm);
//   - every collective of the sharded step runs on the second stream, in
//     the same order on every rank, and the step waits for all of them
//     before the gradient clip reads the rank's part.
//
// The results are those of the run without overlap, bit for bit (the
// same operations in the same order on each buffer); the cost is one
// block's whole gradients more, and at stage 3 one block's
// weights (and under QAD its fake-quantized copy) more.
//
// BF16 gathers (on a backend whose GEMMs read their weights in BF16:
// compute.BF16Rounder, the CUDA backend): the blocks' GEMM weights (the
// Linears' q/k/v/o and gate/up/down, the experts' included) are
// all-gathered as BF16, half the bytes on the wire and in the blocks'
// whole weights (stage 3's slots; stage 2's, kept whole: DeepSpeed's
// BF16 model beside its partitioned fp32 master):
//
//   - a block's gather rounds the rank's part to BF16 (RoundBF16, the
//     rounding every GEMM makes of an fp32 weight) into the rank's place
//     in the block's BF16 whole weights and all-gathers in place (NCCL's
//     in-place layout: no BF16 copy of the parts is kept, and the
//     rounding, of 1/N of a layer, runs with the gather, beside the
//     compute under overlap), and the decoder binds the whole weights as
//     the Linears' weights. At stage 2, where a block's whole weights
//     are its own, the optimizer's step writes that rounding into them
//     as it updates the part (optim.Group.BF16: in AdamW's pass, as an
//     unsharded student's BF16 shadows), and the gather after the step
//     only all-gathers (stepRounds).
//     A GEMM reads the same BF16 bits as it reads of the fp32 gather
//     (rounded per use) or of an unsharded student (its shadow): the run
//     is the fp32 gathers' bit for bit;
//   - the blocks' other tensors (norms, biases, MoE routers: their
//     kernels read them in fp32, and rounding them would change the
//     results) are kept whole in fp32 on every rank for the run (a few
//     MB: a router is experts × hidden a layer), refreshed after each
//     step by one all-gather of a pack of every rank's pieces of them
//     (their parts are wherever the units' cuts put them);
//   - the units outside the blocks (the embedding, read by a lookup in
//     fp32; the final norm and the LM head, a unit) stay fp32;
//   - the master weights, gradients and moments stay fp32 and the layout
//     (units, parts, pieces: the sharded checkpoint) is unchanged.
//
// A backend whose GEMMs read fp32 (the CPU) gathers fp32; so does a
// student made with FP32Gathers (NVFP4 QAD: its calibration and fake
// quantization read the fp32 weights).
type Sharding struct {
	C       compute.Collective
	Stage   int  // 2 or 3
	Overlap bool // run the collectives beside the compute (above)
	// FP32Gathers keeps the gathers of the blocks (and their whole
	// weights) in fp32 where they could be BF16 (above): for NVFP4 QAD
	// (the trainer sets it when quant is nvfp4; EnableQAD and RestoreQAD
	// refuse a student that gathers BF16).
	FP32Gathers bool
}

// unit is a contiguous range of the student's tensors sharded as one.
type unit struct {
	lo, hi   int // tensors [lo, hi) of Student.Tensors
	off, n   int // their range of the logical arena (Tensor.Off)
	per      int // ceil(n/size): each rank's part
	shardOff int // the part's offset in the rank's shard arenas
	bfOff    int // stage 3 under BF16 gathers, a block's: its part's offset in shards.bfPart
	index    int // its place in shards.units
	block    int // the decoder block, or -1
	// outSlot: at stage 3, a unit outside the blocks that holds the
	// embedding table or the LM head, whose whole weights and gradients
	// live in the buffers such units share (see shards.oslot).
	outSlot bool
	roles   int // the decoder.Outside* roles whose tensors it holds (bits)
	// p, g are the unit's whole (padded: size·per) weights and gradients:
	// its own buffers, or the blocks' shared ones (stage 3's p, and every
	// block's g).
	p, g compute.Tensor
}

// shards is a student's sharded state over its group.
type shards struct {
	be          compute.Backend
	c           compute.Collective
	stage       int
	rank, size  int
	units       []unit
	blockUnit   []int          // decoder block -> unit index
	master, gsh compute.Tensor // this rank's parts: fp32 weights, gradients
	overlap     bool
	nslot       int               // stage 3: weight slots (2; 3 with overlap)
	slots       [3]compute.Tensor // stage 3: block i's whole weights are slot i mod nslot
	held        [3]int            // stage 3: the block each slot holds (-1: none)
	loaded      [3]bool           // the slot was filled since Fetch last said so
	slotFence   [3]compute.Fence  // the slot's gather, until a Fetch waits for it
	blockG      [2]compute.Tensor // the blocks' whole gradients (block i's: i mod 2; one without overlap)
	gradFence   [2]compute.Fence  // the buffer's reduction, until the next backward into it waits
	tmp         compute.Tensor    // a reduce-scatter's landing: the largest part
	// Stage 3: the units outside the blocks that hold the embedding
	// table or the LM head (a vocabulary by hidden matrix each: for
	// Qwen3-8B, 622M parameters) share one weight buffer, filled by an
	// all-gather when the decoder fetches their role, and one gradient
	// buffer, reduce-scattered as soon as the role's backward is done (a
	// row's LM head and final norm first, its embedding last), instead
	// of each keeping whole weights and gradients for the run.
	oslot, ograd compute.Tensor
	oheld        int // the unit oslot holds (-1: none)
	own          []compute.Tensor
	// BF16 gathers (see Sharding): the slots are BF16; small holds the
	// blocks' other tensors whole (smallOff: a tensor's offset in it, -1
	// for the rest), which gatherSmall refreshes through spack (this
	// rank's pieces of them, sper elements) and sstage (every rank's).
	bf16          bool
	small         compute.Tensor
	smallOff      []int
	segs          [][]smallSeg // each rank's pieces of the small tensors, in pack order
	sper          int
	spack, sstage compute.Tensor
	// pack and unpack are gatherSmall's copies: destinations [0] and
	// sources [1] (views made at its first call).
	pack, unpack [2][]compute.Tensor
	// bfPart: at stage 3 under BF16 gathers, this rank's parts of the
	// blocks rounded to BF16 (unit.bfOff), written by the optimizer's step
	// (optim.Group.BF16) and by write: a block's gather all-gathers from
	// it. Nil when $DISTILL_ZERO3_ROUND_PER_GATHER=1: each gather then
	// rounds the master part again.
	bfPart compute.Tensor
	// fresh: the unit's gradient part has had no reduction since zeroGrad
	// (it holds nothing yet): its first reduce-scatter lands in it
	// directly, with no landing buffer, addition or zeroing.
	fresh []bool
	// dirty: a backward may have written the whole gradient buffers since
	// they were last all zero. Each reduction zeroes the whole gradients
	// it reduced, so a new student's (New zeroes) and, once a step's
	// backwards have all ended, the step's reductions (reduceRest) leave
	// every one zero: zeroGrad then has nothing to clear. open counts the
	// backwards begun and not ended (one that failed midway stays open,
	// and the next zeroGrad clears them all).
	dirty bool
	open  int
}

// smallSeg is a rank's piece of a block's small tensor (one kept whole in
// fp32 under BF16 gathers): elements [at, at+n) of unit u, at pos in the
// rank's pack and at small in shards.small.
type smallSeg struct{ u, at, n, pos, small int }

// gemmWeight reports whether a block's tensor is the weight of one of
// its Linears that the decoder multiplies by (q/k/v/o_proj, the MLP's or
// an expert's gate/up/down_proj): the tensors a GEMM reads in BF16. The
// MoE router (mlp.gate.weight) is not one: its GEMM runs in fp32.
// TestGEMMWeightsAreLinears holds it to decoder.Block.Linears.
func gemmWeight(name string) bool { return strings.HasSuffix(name, "_proj.weight") }

// blockOf is the decoder block a tensor belongs to, or -1.
func blockOf(name string) int {
	rest, ok := strings.CutPrefix(name, "model.layers.")
	if !ok {
		return -1
	}
	i := strings.IndexByte(rest, '.')
	if i < 0 {
		return -1
	}
	b, err := strconv.Atoi(rest[:i])
	if err != nil {
		return -1
	}
	return b
}

// newShards lays s's tensors out as sh says and allocates this rank's
// state; the decoder's tensors are then views of bind's answers.
func newShards(s *Student, sh Sharding) (*shards, error) {
	if sh.Stage != 2 && sh.Stage != 3 {
		return nil, fmt.Errorf("%w: ZeRO stage %d: the student shards at stages 2 and 3 (stages 0 and 1 keep it whole)", ErrInvalid, sh.Stage)
	}
	h := &shards{be: s.be, c: sh.C, stage: sh.Stage, rank: sh.C.Rank(), size: sh.C.Size(), held: [3]int{-1, -1, -1}, oheld: -1,
		overlap: sh.Overlap, nslot: 2}
	if _, ok := s.be.(compute.BF16Rounder); ok && !sh.FP32Gathers {
		h.bf16 = true
	}
	if h.overlap {
		h.nslot = 3
	}
	for i, t := range s.Tensors {
		b := blockOf(t.Name)
		if n := len(h.units); n > 0 && h.units[n-1].block == b {
			u := &h.units[n-1]
			u.hi, u.n = i+1, u.n+t.N
			continue
		}
		h.units = append(h.units, unit{lo: i, hi: i + 1, off: t.Off, n: t.N, block: b})
	}
	h.blockUnit = make([]int, s.Cfg.Layers)
	for i := range h.blockUnit {
		h.blockUnit[i] = -1
	}
	shardN, maxPer, maxBlock, maxOut := 0, 0, 0, 0
	h.fresh = make([]bool, len(h.units))
	for k := range h.units {
		u := &h.units[k]
		u.index, h.fresh[k] = k, true
		for i := u.lo; i < u.hi; i++ {
			switch s.Tensors[i].Name {
			case "model.embed_tokens.weight":
				u.roles |= 1 << decoder.OutsideEmbed
				if s.Cfg.TieEmbeddings {
					u.roles |= 1 << decoder.OutsideHead
				}
				u.outSlot = h.stage == 3
			case "lm_head.weight":
				u.roles |= 1 << decoder.OutsideHead
				u.outSlot = h.stage == 3
			case "model.norm.weight":
				u.roles |= 1 << decoder.OutsideHead
			}
		}
		if u.block >= 0 {
			if u.block >= len(h.blockUnit) || h.blockUnit[u.block] >= 0 {
				return nil, fmt.Errorf("%w: the tensors of block %d are not contiguous in the config's order", ErrInvalid, u.block)
			}
			h.blockUnit[u.block] = k
		}
		u.per = (u.n + h.size - 1) / h.size
		u.shardOff = shardN
		shardN += u.per
		maxPer = max(maxPer, u.per)
		if u.block >= 0 {
			maxBlock = max(maxBlock, u.per*h.size)
		}
		if u.outSlot {
			maxOut = max(maxOut, u.per*h.size)
		}
	}
	if h.bf16 && !h.alignedGEMMs(s.Tensors) {
		h.bf16 = false
	}
	be := s.be
	h.master, h.gsh = be.New(compute.F32, max(shardN, 1)), be.New(compute.F32, max(shardN, 1))
	h.tmp = be.New(compute.F32, max(maxPer, 1)) // (the collectives run in order: one landing serves)
	for k := range h.gradBufs() {
		h.blockG[k] = be.New(compute.F32, max(maxBlock, 1))
	}
	slotType := compute.F32 // a block's whole weights: slots (3), its own (2)
	if h.bf16 {
		slotType = compute.BF16
		h.layoutSmall(s.Tensors)
	}
	if h.stage == 3 {
		for k := range h.nslot {
			h.slots[k] = be.New(slotType, max(maxBlock, 1))
		}
		if h.bf16 && os.Getenv("DISTILL_ZERO3_ROUND_PER_GATHER") != "1" {
			n := 0
			for k := range h.units {
				if u := &h.units[k]; u.block >= 0 {
					u.bfOff, n = n, n+u.per
				}
			}
			h.bfPart = be.New(compute.BF16, max(n, 1))
		}
		if maxOut > 0 {
			h.oslot, h.ograd = be.New(compute.F32, maxOut), be.New(compute.F32, maxOut)
		}
	}
	for k := range h.units {
		u := &h.units[k]
		whole := u.per * h.size
		switch {
		case u.outSlot:
			u.p, u.g = be.View(h.oslot, 0, whole), be.View(h.ograd, 0, whole)
		case u.block < 0:
			u.p, u.g = be.New(compute.F32, whole), be.New(compute.F32, whole)
			h.own = append(h.own, u.p, u.g)
		case h.stage == 2:
			u.p, u.g = be.New(slotType, whole), be.View(h.blockG[u.block%h.gradBufs()], 0, whole)
			h.own = append(h.own, u.p)
		default:
			u.p, u.g = be.View(h.slots[u.block%h.nslot], 0, whole), be.View(h.blockG[u.block%h.gradBufs()], 0, whole)
		}
	}
	return h, nil
}

// alignedGEMMs reports whether every GEMM weight of a block starts a
// multiple of 8 elements into its unit: in a BF16 slot its view is then
// 16-byte aligned, as the GEMMs' 16-byte loads (the grouped MoE GEMM's
// cp.async) need. Any config whose tensors are multiples of 8 elements
// is (every HF model's; for the seeds' students every offset is a
// multiple of 128 elements, 256 bytes, the alignment of an allocation of
// its own, which selects the same cuBLASLt plans). Otherwise the blocks
// gather fp32 (rounded per use, as before).
func (h *shards) alignedGEMMs(ts []Tensor) bool {
	for _, u := range h.units {
		for i := u.lo; i < u.hi && u.block >= 0; i++ {
			if gemmWeight(ts[i].Name) && (ts[i].Off-u.off)%8 != 0 {
				return false
			}
		}
	}
	return true
}

// layoutSmall lays out the blocks' small tensors (BF16 gathers: the
// blocks' tensors other than GEMM weights) whole in h.small, and every
// rank's pieces of them in the pack gatherSmall gathers: rank r's part
// of a unit is [r·per, (r+1)·per) of it, so a tensor may be cut between
// ranks (and a rank hold pieces of several).
func (h *shards) layoutSmall(ts []Tensor) {
	h.smallOff = make([]int, len(ts))
	h.segs = make([][]smallSeg, h.size)
	n := 0
	for i := range h.smallOff {
		h.smallOff[i] = -1
	}
	for k := range h.units {
		u := &h.units[k]
		if u.block < 0 {
			continue
		}
		for i := u.lo; i < u.hi; i++ {
			t := ts[i]
			if gemmWeight(t.Name) {
				continue
			}
			h.smallOff[i] = n
			lo, hi := t.Off-u.off, t.Off-u.off+t.N // of the unit
			for r := range h.size {
				a, b := max(lo, r*u.per), min(hi, (r+1)*u.per)
				if a < b {
					h.segs[r] = append(h.segs[r], smallSeg{u: k, at: a, n: b - a, small: n + a - lo})
				}
			}
			n += t.N
		}
	}
	for r := range h.segs {
		pos := 0
		for j := range h.segs[r] {
			h.segs[r][j].pos = pos
			pos += h.segs[r][j].n
		}
		h.sper = max(h.sper, pos)
	}
	be := h.be
	h.small = be.New(compute.F32, max(n, 1))
	if h.sper > 0 {
		h.spack, h.sstage = be.New(compute.F32, h.sper), be.New(compute.F32, h.size*h.sper)
	}
}

// gatherSmall refreshes the blocks' small tensors (BF16 gathers) from
// the ranks' master parts: each rank packs its pieces of them, one
// all-gather, each rank unpacks every rank's (a collective; copies only,
// so bit for bit the masters). The pieces are a few hundred (four norms a
// layer), of a few KB: on a backend that copies many tensors in one
// launch (compute.MultiTensor) the pack and the unpack are a launch each.
func (h *shards) gatherSmall() {
	if h.sper == 0 {
		return
	}
	be := h.be
	if h.unpack[0] == nil { // (sper > 0: some rank has a piece)
		for _, g := range h.segs[h.rank] {
			u := &h.units[g.u]
			h.pack[0] = append(h.pack[0], be.View(h.spack, g.pos, g.n))
			h.pack[1] = append(h.pack[1], be.View(h.master, u.shardOff+g.at-h.rank*u.per, g.n))
		}
		for r, gs := range h.segs {
			for _, g := range gs {
				h.unpack[0] = append(h.unpack[0], be.View(h.small, g.small, g.n))
				h.unpack[1] = append(h.unpack[1], be.View(h.sstage, r*h.sper+g.pos, g.n))
			}
		}
	}
	copyEach(be, h.pack[0], h.pack[1])
	h.c.AllGather(h.sstage, h.spack, h.sper)
	copyEach(be, h.unpack[0], h.unpack[1])
}

// copyEach copies srcs[i] into dsts[i], in one launch where be can.
func copyEach(be compute.Backend, dsts, srcs []compute.Tensor) {
	if mt, ok := be.(compute.MultiTensor); ok {
		mt.CopyEach(dsts, srcs)
		return
	}
	for i := range dsts {
		be.Copy(dsts[i], srcs[i])
	}
}

// gradBufs is the number of whole gradient buffers the blocks share in
// turn: two with overlap (one reduced while the other fills), else one.
func (h *shards) gradBufs() int {
	if h.overlap {
		return 2
	}
	return 1
}

// collective runs f, which issues collectives (and the kernels that use
// their results), beside the compute with overlap (its Fence returned),
// else in order (a Fence whose Wait does nothing).
func (h *shards) collective(f func()) compute.Fence {
	if !h.overlap {
		f()
		return nil
	}
	return compute.Beside(h.be, f)
}

// wait waits for *f (if any) and clears it.
func wait(f *compute.Fence) {
	if *f != nil {
		(*f).Wait()
		*f = nil
	}
}

// drain waits for every collective still running beside the compute.
func (h *shards) drain() {
	for k := range h.gradFence {
		wait(&h.gradFence[k])
	}
	for k := range h.slotFence {
		wait(&h.slotFence[k])
	}
}

// unitOf is the unit of tensor i.
func (h *shards) unitOf(i int) *unit {
	for k := range h.units {
		if u := &h.units[k]; i >= u.lo && i < u.hi {
			return u
		}
	}
	panic(fmt.Sprintf("train: tensor %d is in no unit", i))
}

// views are tensor t's (index i) weights and gradient in its unit's
// whole buffers: what the decoder binds.
func (h *shards) views(i int, t Tensor) (w, g compute.Tensor) {
	u := h.unitOf(i)
	w = h.be.View(u.p, t.Off-u.off, t.N)
	if h.bf16 && h.smallOff[i] >= 0 {
		w = h.be.View(h.small, h.smallOff[i], t.N)
	}
	return w, h.be.View(u.g, t.Off-u.off, t.N)
}

// write stores the whole values v of tensor i: this rank's part in the
// master weights, all of it in the unit's own whole buffer (a block's
// shared slot at stage 3 is filled by the next fetch).
func (h *shards) write(i int, t Tensor, v []float32) {
	h.drain()
	u, be := h.unitOf(i), h.be
	switch {
	case u.outSlot:
		h.oheld = -1
	case u.block < 0 || h.stage == 2:
		// (A BF16 block's GEMM weights rounded to nearest even here, as
		// RoundBF16 rounds them.)
		be.WriteF32(be.View(u.p, t.Off-u.off, t.N), v)
	default:
		h.held = [3]int{-1, -1, -1}
	}
	if h.bf16 && h.smallOff[i] >= 0 {
		be.WriteF32(be.View(h.small, h.smallOff[i], t.N), v)
	}
	lo, hi := max(h.rank*u.per, t.Off-u.off), min((h.rank+1)*u.per, t.Off-u.off+t.N)
	if lo < hi {
		mine := v[lo-(t.Off-u.off) : hi-(t.Off-u.off)]
		be.WriteF32(be.View(h.master, u.shardOff+lo-h.rank*u.per, hi-lo), mine)
		if h.bfPart != nil && u.block >= 0 { // (rounded to nearest even, as RoundBF16)
			be.WriteF32(be.View(h.bfPart, u.bfOff+lo-h.rank*u.per, hi-lo), mine)
		}
	}
}

// part is this rank's part of unit u in a shard arena.
func (h *shards) part(arena compute.Tensor, u *unit) compute.Tensor {
	return h.be.View(arena, u.shardOff, u.per)
}

// gather fills u's whole weights from the ranks' parts (beside the
// compute with overlap: the caller waits for the Fence before use); a
// block's under BF16 gathers from the parts' BF16 roundings: at stage 3
// the ranks' kept roundings (bfPart), else each rank's made in its place
// in the whole weights (an in-place all-gather).
func (h *shards) gather(u *unit) compute.Fence {
	return h.collective(func() { h.gatherNow(u) })
}

// gatherNow issues gather's work on the backend's current stream.
func (h *shards) gatherNow(u *unit) {
	if h.bf16 && u.block >= 0 && h.bfPart != nil {
		h.c.AllGather(u.p, h.be.View(h.bfPart, u.bfOff, u.per), u.per)
		return
	}
	if h.bf16 && u.block >= 0 {
		mine := h.be.View(u.p, h.rank*u.per, u.per)
		if !h.stepRounds(u) {
			h.be.(compute.BF16Rounder).RoundBF16(mine, h.part(h.master, u), u.per)
		}
		h.c.AllGather(u.p, mine, u.per)
		return
	}
	h.c.AllGather(u.p, h.part(h.master, u), u.per)
}

// stepRounds reports whether the optimizer step rounds u's part into
// its place in u's BF16 whole weights (the groups' optim.Group.BF16, in
// AdamW's pass): at ZeRO 2 under BF16 gathers, a block's whole weights
// are its own, so the step's rounding stays there until the gather after
// it (AfterStep), which then only all-gathers. The part's padding (the
// last rank's) is 0 in the master and in the whole weights from the
// start. The master parts change only by the optimizer and by write,
// which writes the whole weights too. At stage 3 the slots are shared:
// the step rounds into bfPart instead (stepBF16), or without it each
// gather rounds.
func (h *shards) stepRounds(u *unit) bool { return h.bf16 && h.stage == 2 && u.block >= 0 }

// stepBF16 is where the optimizer's step writes the BF16 rounding of the
// n elements of unit u's part at offset off into the part (optim.Group.BF16),
// or nil: u's place in its whole weights at stage 2 (stepRounds), its
// place in bfPart at stage 3. At stage 3 this keeps 2/N bytes a parameter
// more (DeepSpeed's ZeRO-3 keeps its parameters' partitions in BF16 so)
// and spares each gather a pass over the master part: reading 4 bytes and
// writing 2 for every element, where the gather now reads 2 (2 bytes a
// parameter less per gather at world size 1, where the all-gather is a
// copy; a block is gathered for its forward and again for its backward).
func (h *shards) stepBF16(u *unit, off, n int) compute.Tensor {
	switch {
	case h.stepRounds(u):
		return h.be.View(u.p, h.rank*u.per+off, n)
	case h.bfPart != nil && u.block >= 0:
		return h.be.View(h.bfPart, u.bfOff+off, n)
	}
	return nil
}

// reduce sums u's whole gradients over the ranks into this rank's part
// (+=) and clears them (beside the compute with overlap). The step's first
// reduction of u writes its part (fresh: zeroGrad left it unwritten), the
// next ones land in tmp and add: a step of one row per rank reads and
// writes each part once, not three times plus a clearing.
func (h *shards) reduce(u *unit) compute.Fence { return h.collective(h.reducer(u)) }

// reducer returns the work of reduce (to issue on the backend's current
// stream, in the order of the reducers' calls).
func (h *shards) reducer(u *unit) func() {
	be := h.be
	k := u.index
	fresh := h.fresh[k]
	h.fresh[k] = false
	return func() {
		if fresh {
			h.c.ReduceScatterSum(h.part(h.gsh, u), u.g, u.per)
		} else {
			tmp := be.View(h.tmp, 0, u.per)
			h.c.ReduceScatterSum(tmp, u.g, u.per)
			be.Add(h.part(h.gsh, u), tmp, u.per)
		}
		be.Zero(u.g)
	}
}

// Fetch implements decoder.Residency: block i's gradients may be written
// from now on (their buffer's last reduction is waited for); at stage 3
// block i's whole weights are gathered into its slot, unless the slot
// holds them already.
func (h *shards) Fetch(i int) bool {
	wait(&h.gradFence[i%h.gradBufs()])
	if h.stage < 3 {
		return false
	}
	h.load(i)
	l := h.loaded[i%h.nslot]
	h.loaded[i%h.nslot] = false
	return l
}

// Prefetch implements decoder.Prefetcher: with overlap at stage 3, block
// i's gather starts now, beside the compute, into its slot (whose block
// the decoder no longer reads: see Sharding).
func (h *shards) Prefetch(i int) {
	if h.stage < 3 || !h.overlap || h.held[i%h.nslot] == i {
		return
	}
	s := i % h.nslot
	wait(&h.slotFence[s]) // (an earlier gather into it, never fetched)
	h.slotFence[s] = h.gather(&h.units[h.blockUnit[i]])
	h.held[s], h.loaded[s] = i, true
}

// load gathers block i's whole weights into its slot, unless the slot
// holds them already, and waits for its gather. (Weights loads blocks
// too, between the decoder's fetches: loaded tells the decoder's next
// Fetch.)
func (h *shards) load(i int) {
	s := i % h.nslot
	if h.held[s] != i {
		wait(&h.slotFence[s])
		h.slotFence[s] = h.gather(&h.units[h.blockUnit[i]])
		h.held[s], h.loaded[s] = i, true
	}
	wait(&h.slotFence[s])
}

// GradsDone implements decoder.Residency: block i's gradients go to
// their ranks (beside the blocks' backwards that follow, with overlap).
func (h *shards) GradsDone(i int) {
	h.gradFence[i%h.gradBufs()] = h.reduce(&h.units[h.blockUnit[i]])
}

// FetchOutside implements decoder.Residency: at stage 3 the units that
// hold role's tensors in the shared outside buffer are gathered into it,
// unless it holds them already (the others keep whole weights).
func (h *shards) FetchOutside(role int) {
	for k := range h.units {
		if u := &h.units[k]; u.outSlot && u.roles&(1<<role) != 0 {
			h.loadOutside(k)
		}
	}
}

// loadOutside gathers unit k's whole weights into the outside buffer,
// unless it holds them already.
func (h *shards) loadOutside(k int) {
	if h.oheld == k {
		return
	}
	f := h.gather(&h.units[k])
	wait(&f)
	h.oheld = k
}

// OutsideGradsDone implements decoder.Residency: at stage 3 the
// gradients of the units outside the blocks go to their ranks as soon as
// their role's backward is done, a row at a time: the LM head's unit
// (and the final norm's) after the final norm's backward, the
// embedding's after the embedding's backward (tied embeddings: the LM
// head's gradients are the embedding's, made first and last: reduced
// with the embedding). At stage 2 they stay whole over the step's rows
// (ReduceShardGrads).
func (h *shards) OutsideGradsDone(role int) {
	if h.stage < 3 {
		return
	}
	for k := range h.units {
		u := &h.units[k]
		if u.block >= 0 || u.roles&(1<<role) == 0 {
			continue
		}
		if role == decoder.OutsideHead && u.roles&(1<<decoder.OutsideEmbed) != 0 {
			continue // tied: the embedding's backward adds to them still
		}
		// (In order: the embedding's and the LM head's units share one
		// gradient buffer.)
		f := h.reduce(u)
		wait(&f)
	}
}

// Slots implements decoder.Residency.
func (h *shards) Slots() int {
	if h.stage == 3 {
		return h.nslot
	}
	return 0
}

// zeroGrad clears this rank's gradient parts (each unit's is written by
// its first reduction, or zeroed by reduceRest if it has none) and, unless
// the reductions left them zero (dirty), every whole gradient buffer.
func (h *shards) zeroGrad() {
	h.drain()
	for k := range h.fresh {
		h.fresh[k] = true
	}
	dirty := h.dirty
	h.dirty, h.open = false, 0
	if !dirty {
		return
	}
	for k := range h.gradBufs() {
		h.be.Zero(h.blockG[k])
	}
	if h.ograd != nil {
		h.be.Zero(h.ograd)
	}
	for k := range h.units {
		if h.units[k].block < 0 && !h.units[k].outSlot {
			h.be.Zero(h.units[k].g)
		}
	}
}

// reduceRest reduce-scatters the gradients of the units outside the
// blocks (after a step's last backward), one after another (with overlap
// beside the compute, and waited for once).
func (h *shards) reduceRest() {
	if h.stage < 3 { // (stage 3: reduced a row at a time, OutsideGradsDone)
		var work []func()
		for k := range h.units {
			if h.units[k].block < 0 {
				work = append(work, h.reducer(&h.units[k]))
			}
		}
		f := h.collective(func() {
			for _, w := range work {
				w()
			}
		})
		wait(&f)
	}
	h.drain() // the rank's part is complete
	for k, f := range h.fresh {
		if f { // no gradient reached the unit this step
			h.be.Zero(h.part(h.gsh, &h.units[k]))
			h.fresh[k] = false
		}
	}
	if h.open == 0 { // every unit reduced, its whole gradients zeroed
		h.dirty = false
	}
}

// backward says that a backward begins (the loss head's, then the
// decoder's): it writes the whole gradient buffers (see dirty).
func (h *shards) backward() { h.dirty, h.open = true, h.open+1 }

// backwardDone says that the backward begun last has ended: every block's
// gradients, and at stage 3 every unit's, were handed to reduce.
func (h *shards) backwardDone() { h.open-- }

// afterStep makes the whole weights follow the updated parts: the units
// that keep theirs are gathered, one after another (with overlap beside
// the compute, and waited for once), stage 3's slots are stale.
func (h *shards) afterStep() {
	h.drain()
	f := h.collective(func() {
		for k := range h.units {
			if u := &h.units[k]; !u.outSlot && (u.block < 0 || h.stage == 2) {
				h.gatherNow(u)
			}
		}
	})
	wait(&f)
	h.held, h.oheld = [3]int{-1, -1, -1}, -1
	if h.bf16 {
		h.gatherSmall()
	}
}

// Piece is the part [Off, Off+N) of the student's tensor Tensor (its
// index in Student.Tensors) that a rank's optimizer group holds.
type Piece struct{ Tensor, Off, N int }

// pieces are rank r's optimizer groups, in order: its part of every
// unit, cut at the tensors' boundaries. shardOff is each piece's offset
// in r's shard arenas.
func (h *shards) pieces(ts []Tensor, r int) (ps []Piece, shardOff []int) {
	for k := range h.units {
		u := &h.units[k]
		a, b := r*u.per, min((r+1)*u.per, u.n) // of the unit
		for i := u.lo; i < u.hi; i++ {
			t := ts[i]
			lo, hi := max(a, t.Off-u.off), min(b, t.Off-u.off+t.N)
			if lo < hi {
				ps = append(ps, Piece{Tensor: i, Off: lo - (t.Off - u.off), N: hi - lo})
				shardOff = append(shardOff, u.shardOff+lo-a)
			}
		}
	}
	return ps, shardOff
}

// groups are this rank's optimizer groups (see pieces).
func (h *shards) groups(ts []Tensor) []optim.Group {
	ps, offs := h.pieces(ts, h.rank)
	gs := make([]optim.Group, len(ps))
	host, _ := h.be.(compute.Host)
	for j, p := range ps {
		t := ts[p.Tensor]
		g := optim.Group{Name: t.Name, Decay: t.Decay, Backend: h.be,
			P: h.be.View(h.master, offs[j], p.N), G: h.be.View(h.gsh, offs[j], p.N)}
		if u := h.unitOf(p.Tensor); u != nil {
			g.BF16 = h.stepBF16(u, offs[j]-u.shardOff, p.N)
		}
		if host != nil {
			g.Params, g.Grads = host.HostF32(g.P), host.HostF32(g.G)
		}
		gs[j] = g
	}
	return gs
}

// weights reads every tensor's whole weights (a collective at stage 3:
// every rank calls it, each gets them all).
func (h *shards) weights(ts []Tensor) map[string][]float32 {
	w := make(map[string][]float32, len(ts))
	for k := range h.units {
		u := &h.units[k]
		if h.bf16 && u.block >= 0 {
			// The slots hold BF16 roundings: the masters, a rank's part
			// at a time.
			v := h.masterWhole(u)
			for i := u.lo; i < u.hi; i++ {
				t := ts[i]
				w[t.Name] = v[t.Off-u.off : t.Off-u.off+t.N : t.Off-u.off+t.N]
			}
			continue
		}
		switch {
		case u.outSlot:
			h.loadOutside(k)
		case u.block >= 0 && h.stage == 3:
			h.load(u.block)
		}
		for i := u.lo; i < u.hi; i++ {
			t := ts[i]
			v := make([]float32, t.N)
			h.be.ReadF32(h.be.View(u.p, t.Off-u.off, t.N), v)
			w[t.Name] = v
		}
	}
	return w
}

// masterWhole reads unit u's whole fp32 master weights to the host, each
// rank's part broadcast in turn through tmp (a collective: every rank
// calls it).
func (h *shards) masterWhole(u *unit) []float32 {
	h.drain() // (tmp is the reductions' landing)
	be := h.be
	v := make([]float32, h.size*u.per)
	tmp := be.View(h.tmp, 0, u.per)
	for r := range h.size {
		if r == h.rank {
			be.Copy(tmp, h.part(h.master, u))
		}
		h.c.Broadcast(tmp, u.per, r)
		be.ReadF32(tmp, v[r*u.per:(r+1)*u.per])
	}
	return v
}

func (h *shards) free() {
	h.drain()
	for _, t := range append([]compute.Tensor{h.master, h.gsh, h.tmp, h.blockG[0], h.blockG[1], h.slots[0], h.slots[1], h.slots[2], h.oslot, h.ograd,
		h.small, h.spack, h.sstage, h.bfPart}, h.own...) {
		if t != nil {
			h.be.Free(t)
		}
	}
}
