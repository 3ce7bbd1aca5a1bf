package cuda

import (
	"fmt"

	"distill/compute"
)

// Launch geometry and memory planning: pure functions of the shapes, so
// they are unit-tested on any machine. The kernels' side of each contract
// is in the comment of the kernel named.

// launch is one kernel launch's geometry.
type launch struct {
	kernel string
	grid   [3]int
	block  int
	smem   int // dynamic shared memory, bytes
}

const (
	ewThreads   = 256
	ewMaxBlocks = 1 << 16 // grid-stride loops cover the rest
)

// elementwiseGrid is the grid of a grid-stride loop over n elements.
func elementwiseGrid(n int64) [3]int {
	b := (n + ewThreads - 1) / ewThreads
	return [3]int{int(max(1, min(b, ewMaxBlocks))), 1, 1}
}

// rmsnormLaunch: one warp per row (8 rows a block) when dim <= 1024, else
// one 256-thread block per row (k_rmsnorm_warp, k_rmsnorm_block).
func rmsnormLaunch(rows, dim int) launch {
	if dim <= 1024 {
		return launch{kernel: "k_rmsnorm_warp", grid: [3]int{(rows + 7) / 8, 1, 1}, block: 256}
	}
	return launch{kernel: "k_rmsnorm_block", grid: [3]int{rows, 1, 1}, block: 256}
}

// ropeLaunch: one block per token, its threads over the token's
// heads·hd/2 rotations (k_rope_table).
func ropeLaunch(tokens, heads, hd int) (launch, error) {
	if hd%2 != 0 || hd < 2 {
		return launch{}, fmt.Errorf("cuda: RoPE head_dim %d: want an even head_dim >= 2", hd)
	}
	return launch{kernel: "k_rope_table", grid: [3]int{tokens, 1, 1}, block: min(256, max(32, (heads*hd/2+31)/32*32))}, nil
}

// Attention kernels (attention.cu).
const (
	simtBQ = 16 // SIMT_BQ
	// The tensor-core kernels (FlashAttention 2's way): mmaBQ rows (queries,
	// or keys for the dkv kernel) a block of mmaThreads threads (FA_ROWS,
	// FA_THREADS), the forward's key steps mmaFwdBK (FA_BK), dq's key steps
	// mmaDqBK (FA_DQ_BK), dkv's query steps mmaDkvBQ (FA_DKV_BQ).
	mmaBQ      = 128
	mmaThreads = 256
	mmaFwdBK   = 64
	mmaDqBK    = 64
	mmaDkvBQ   = 64
)

// mmaFwdSmem is the forward kernel's dynamic shared memory for head_dim hd:
// two stages of a K and a V tile, BF16 rows padded to hd+8 (the Q tile is
// staged in the second stage).
func mmaFwdSmem(hd int) int { return 4 * mmaFwdBK * (hd + 8) * 2 }

// attnMode picks the attention kernel: "mma" (tensor cores, head_dim 64 or
// 128), "simt" (fp32, head_dim <= 256), or "auto" (mma when it applies).
type attnMode string

// attentionLaunch plans Attention for nSeq packed samples of tokens tokens:
// the plan kernel's geometry, and the attention kernel's, whose grid.x is
// an upper bound on the query tiles, sum over samples of ceil(len/BQ)
// <= (tokens + nSeq·(BQ-1)) / BQ, and grid.y the query heads.
func attentionLaunch(mode attnMode, tokens, nSeq, nHead, nKV, hd int) (plan, attn launch, err error) {
	switch {
	case nHead <= 0 || nKV <= 0 || nHead%nKV != 0:
		return plan, attn, fmt.Errorf("cuda: attention with %d query heads and %d kv heads: want kv heads dividing query heads", nHead, nKV)
	case nSeq <= 0 || tokens < nSeq:
		return plan, attn, fmt.Errorf("cuda: attention over %d samples of %d tokens: want 1 <= samples <= tokens", nSeq, tokens)
	}
	kernel, bq, threads, smem := "", 0, 128, 0
	switch {
	case mode != "simt" && (hd == 64 || hd == 128):
		kernel, bq, threads, smem = fmt.Sprintf("k_attn_mma%d", hd), mmaBQ, mmaThreads, mmaFwdSmem(hd)
	case mode == "mma":
		return plan, attn, fmt.Errorf("cuda: the tensor-core attention kernel needs head_dim 64 or 128, not %d", hd)
	case hd <= 256 && hd > 0:
		kernel, bq = "k_attn_simt", simtBQ
	default:
		return plan, attn, fmt.Errorf("cuda: attention head_dim %d: want 1..256", hd)
	}
	tiles := (tokens + nSeq*(bq-1)) / bq
	plan = launch{kernel: "k_attn_plan", grid: [3]int{1, 1, 1}, block: 1024}
	attn = launch{kernel: kernel, grid: [3]int{tiles, nHead, 1}, block: threads, smem: smem}
	return plan, attn, nil
}

// The LM head (lmhead.cu): cuBLASLt writes a (rows x cols) F32 logit tile,
// which k_lm_fold folds in lmTile-column pieces.
const (
	lmTile        = 4096      // LM_TILE
	lmTileBudget  = 256 << 20 // bytes of logits a GEMM tile may take
	lmFoldThreads = 256
)

// The most vocab columns and token rows of one LM-head GEMM: variables so
// that tests can force several slabs and tiles on small shapes.
var (
	lmMaxCols = 4 * lmTile
	lmMaxRows = 8192
)

// lmPlan is the tiling of one LMHeadTopK call.
type lmPlan struct {
	rows, cols int   // one GEMM's logit tile: slab rows x vocab columns
	foldSmem   int   // k_lm_fold's dynamic shared memory
	scratch    int64 // device bytes beside the outputs
}

// planLMHead tiles tokens x vocab: the vocabulary in GEMMs of up to
// lmMaxCols columns (a multiple of lmTile, so every tile's weight pointer
// stays 16-byte aligned), the tokens in slabs whose logit tile fits
// lmTileBudget. Scratch: the logit tile, the slab's BF16 activations and
// the running statistics (rmax f32, rsum f64, cnt i32 per token).
func planLMHead(tokens, hidden, vocab, k int) (lmPlan, error) {
	if k < 1 || k > vocab {
		return lmPlan{}, fmt.Errorf("cuda: LM-head top-k %d: want 1..vocab (%d)", k, vocab)
	}
	cols := min((vocab+lmTile-1)/lmTile*lmTile, lmMaxCols)
	rows := min(tokens, lmMaxRows, max(1, lmTileBudget/(4*cols)))
	p := lmPlan{rows: rows, cols: cols, foldSmem: 8 * (lmTile + k)}
	p.scratch = int64(rows)*int64(cols)*4 + int64(rows)*int64(hidden)*2 + int64(tokens)*16
	return p, nil
}

// lmSamplePlan is the tiling of one LMHeadSample call: LMHeadTopK's, with
// slabs small enough that the draws' per-row scratch fits lmTileBudget too.
type lmSamplePlan struct {
	lmPlan
	nblk, ntile int // blocks of compute.SampleBlock ids, fold tiles of lmTile
}

// planLMHeadSample tiles LMHeadSample as planLMHead tiles LMHeadTopK (k 0
// allowed), its slabs' rows also bounded so that their draws' scratch
// (bsum f64 a block; tmax fp32, tsum f64 a tile; the draws' block i32
// and threshold f64) fits lmTileBudget.
func planLMHeadSample(tokens, hidden, vocab, k, n int) (lmSamplePlan, error) {
	if compute.SampleBlock != 64 || lmTile%compute.SampleBlock != 0 {
		return lmSamplePlan{}, fmt.Errorf("cuda: lmhead.cu's LM_BLOCK is 64, compute.SampleBlock %d", compute.SampleBlock)
	}
	if k < 0 || k > vocab {
		return lmSamplePlan{}, fmt.Errorf("cuda: LM-head top-k %d: want 0..vocab (%d)", k, vocab)
	}
	p, err := planLMHead(tokens, hidden, vocab, max(k, 1))
	if err != nil {
		return lmSamplePlan{}, err
	}
	sp := lmSamplePlan{lmPlan: p, nblk: (vocab + compute.SampleBlock - 1) / compute.SampleBlock, ntile: (vocab + lmTile - 1) / lmTile}
	perRow := int64(sp.nblk)*8 + int64(sp.ntile)*12 + int64(n)*12
	sp.rows = min(sp.rows, max(1, int(lmTileBudget/perRow)))
	sp.scratch = int64(sp.rows)*int64(sp.cols)*4 + int64(sp.rows)*int64(hidden)*2 + int64(tokens)*16 + int64(sp.rows)*perRow
	return sp, nil
}

// moePlan lays the (token, expert) pairs of a MoE layer out by expert:
// expert e's rows are [offsets[e], offsets[e+1]) of the grouped
// activations, rows = the number of pairs (tokens·K).
type moePlan struct {
	offsets []int32 // E+1
	rows    int
	busiest int // the most rows of one expert
}

// planMoE turns per-expert row counts (from k_moe_route) into the layout,
// checking that they add up to tokens·K (a mismatch means the routing
// kernel failed).
func planMoE(counts []int32, tokens, K int) (moePlan, error) {
	p := moePlan{offsets: make([]int32, len(counts)+1)}
	for e, c := range counts {
		if c < 0 || int(c) > tokens {
			return p, fmt.Errorf("cuda: MoE routing gave expert %d %d rows of %d tokens", e, c, tokens)
		}
		p.offsets[e+1] = p.offsets[e] + c
		p.busiest = max(p.busiest, int(c))
	}
	p.rows = int(p.offsets[len(counts)])
	if p.rows != tokens*K {
		return p, fmt.Errorf("cuda: MoE routing assigned %d rows, want tokens·top_k = %d·%d = %d", p.rows, tokens, K, tokens*K)
	}
	return p, nil
}

// moeScratchBytes bounds what one MoE call of a teacher's forward
// allocates beside its output: the router's logits and F32 copy, the
// choices and the grouping (sel, wts, order, rowpos, offsets, counts,
// tile starts), the experts' weight address arrays and the down
// projections (F32); then, with BF16 experts (the default kernels), the
// tokens in BF16 and the BF16 activations: gate and up are never stored
// (k_moe_gemm_glu). With FP8 experts on the device's grouping
// (fp8Grouped: moeExpertsFP8Grouped) the tokens' codes and scales, h (F32)
// and its codes and scales; on the host's (moeExpertsFP8) gate and up
// (F32) and the tokens' and the grouped rows' codes and scales. The
// earlier BF16 kernels (Options.MoEGEMM v1: a gathered input, gate and up
// stored) and a QAD student's forward take more: the training plan counts
// those.
func moeScratchBytes(tokens, hidden, inter, experts, K int, fp8, fp8Grouped bool) int64 {
	n, r := int64(tokens), int64(tokens)*int64(K)
	H, I, E := int64(hidden), int64(inter), int64(experts)
	b := 4*n*E + 4*E*H + 16*r + 12*(E+1) + 24*E + 4*r*H
	switch {
	case fp8 && fp8Grouped:
		return b + 24*E + 4*r*I + max(n*H+4*n, r*I+4*r)
	case fp8:
		return b + 8*r*I + n*H + 4*n + r*max(H, I) + 4*r
	}
	return b + 2*n*H + 2*r*I
}

// The attention backward's tiles (attention.cu: BWD_BQ queries or keys a
// block of the SIMT kernels; the tensor-core ones use mmaBQ).
const bwdBQ = 16

// attnBwdPlan is the geometry of one AttentionBackward: the plan kernel's
// tile size bq, and either the SIMT pair (dq, dkv) or the tensor-core
// chain (dsum: D from the forward's output, or from O recomputed by fwd
// when there is none; dq; dkv).
type attnBwdPlan struct {
	bq              int
	mma             bool
	plan, fwd, dsum launch
	dq, dkv         launch
}

// mmaBwdSmem is the dynamic shared memory of k_attn_bwd_dq_mma and
// k_attn_bwd_dkv_mma for head_dim hd, BF16 rows padded to hd+8: dq's Q and
// dO tiles (mmaBQ rows each) and two stages of a K and a V tile (mmaDqBK
// rows each); dkv's K and V tiles (mmaBQ rows each) and two stages of a Q
// and a dO tile (mmaDkvBQ rows each) and of mmaDkvBQ lse and D floats.
func mmaBwdSmem(hd int) (dq, dkv int) {
	row := (hd + 8) * 2
	return (2*mmaBQ + 4*mmaDqBK) * row, (2*mmaBQ+4*mmaDkvBQ)*row + 4*mmaDkvBQ*4
}

// attentionBackwardLaunch plans AttentionBackward for nSeq packed samples
// of tokens tokens: the tensor-core kernels for head_dim 64 and 128 (unless
// mode is "simt"), else the fp32 SIMT kernels (head_dim <= 256), each over
// (tiles, heads) with grid.x the upper bound on the tiles as in
// attentionLaunch: 128 threads a block for the SIMT kernels, mmaThreads
// for the tensor-core ones (whose dkv grid's tiles are of keys).
func attentionBackwardLaunch(mode attnMode, tokens, nSeq, nHead, nKV, hd int) (attnBwdPlan, error) {
	var p attnBwdPlan
	switch {
	case nHead <= 0 || nKV <= 0 || nHead%nKV != 0:
		return p, fmt.Errorf("cuda: attention backward with %d query heads and %d kv heads: want kv heads dividing query heads", nHead, nKV)
	case nSeq <= 0 || tokens < nSeq:
		return p, fmt.Errorf("cuda: attention backward over %d samples of %d tokens: want 1 <= samples <= tokens", nSeq, tokens)
	case hd <= 0 || hd > 256:
		return p, fmt.Errorf("cuda: attention backward head_dim %d: want 1..256", hd)
	case mode == "mma" && hd != 64 && hd != 128:
		return p, fmt.Errorf("cuda: the tensor-core attention backward needs head_dim 64 or 128, not %d", hd)
	}
	p.plan = launch{kernel: "k_attn_plan", grid: [3]int{1, 1, 1}, block: 1024}
	p.mma = mode != "simt" && (hd == 64 || hd == 128)
	if !p.mma {
		p.bq = bwdBQ
		tiles := (tokens + nSeq*(bwdBQ-1)) / bwdBQ
		p.dq = launch{kernel: "k_attn_bwd_dq", grid: [3]int{tiles, nHead, 1}, block: 128}
		p.dkv = launch{kernel: "k_attn_bwd_dkv", grid: [3]int{tiles, nKV, 1}, block: 128}
		return p, nil
	}
	p.bq = mmaBQ
	tiles := (tokens + nSeq*(mmaBQ-1)) / mmaBQ
	dqSmem, dkvSmem := mmaBwdSmem(hd)
	p.fwd = launch{kernel: fmt.Sprintf("k_attn_mma%d", hd), grid: [3]int{tiles, nHead, 1}, block: mmaThreads, smem: mmaFwdSmem(hd)}
	p.dsum = launch{kernel: "k_attn_dsum", grid: [3]int{(tokens*nHead + 7) / 8, 1, 1}, block: 256}
	p.dq = launch{kernel: fmt.Sprintf("k_attn_bwd_dq_mma%d", hd), grid: [3]int{tiles, nHead, 1}, block: mmaThreads, smem: dqSmem}
	p.dkv = launch{kernel: fmt.Sprintf("k_attn_bwd_dkv_mma%d", hd), grid: [3]int{tiles, nKV, 1}, block: mmaThreads, smem: dkvSmem}
	return p, nil
}

// ForwardScratchBytes implements compute.DeviceMemory: the most device
// memory one kernel call of a forward of shape s allocates beside its
// inputs and outputs (each call frees its scratch before the next one
// allocates): a MatMul's BF16 rounding of its widest input, the own
// attention kernels' BF16 copies of q, k and v and their tile list, the LM
// head's tiles and statistics, a MoE layer's grouping and expert
// activations. Copies of weights the backend keeps after their
// first use (BF16 copies of F32 GEMM weights, F32 copies of BF16 routers)
// are not scratch: a caller measures them after a first small forward.
//
// With cuDNN the attention's scratch is its BF16 copies of q, k, v and the
// output, the stats when the caller keeps none and the per-sample offsets;
// the engine's workspace is not known before its plan is built (each
// build logs it), and is not counted.
func (b *Backend) ForwardScratchBytes(s compute.ForwardShape) int64 {
	grouped, sums := b.mmaE4M3(), !b.fp8OuterVec
	if b.dnn != nil {
		layers, head := scratchTermsCuDNN(s, grouped, sums)
		return max(layers, head)
	}
	layers, head := forwardScratchTermsFor(s, grouped, sums)
	return max(layers, head)
}

// ForwardScratchBound is ForwardScratchBytes of a backend with cuDNN (the
// default where it loads), computed without a device: for memory plans
// made on paper.
func ForwardScratchBound(s compute.ForwardShape) int64 {
	layers, head := ForwardScratchTerms(s)
	return max(layers, head)
}

// ForwardScratchTerms splits ForwardScratchBound into the decoder layers'
// largest kernel scratch (attention's copies and workspace, the GEMMs'
// operand copies, MoE's grouping) and the LM head's (its logit tile, the
// draws'; 0 under s.NoHead). A forward never holds both: each call frees
// its scratch before the next call's allocations.
//
// On paper an FP8 MoE's experts run on the device's grouping (an sm_89 or
// newer GPU, NVRTC 12.4 or newer: Backend.mmaE4M3); a backend without it
// counts the per-expert path's larger scratch (ForwardScratchBytes). An
// FP8 MatMul counts its fp32 sums (fp8.go: the path of a cuBLASLt before
// 12.9), which the outer-vector scales do without.
func ForwardScratchTerms(s compute.ForwardShape) (layers, head int64) {
	return scratchTermsCuDNN(s, true, true)
}

// scratchTermsCuDNN is ForwardScratchTerms with cuDNN's attention, grouped
// as moeScratchBytes' fp8Grouped, sums as forwardScratchTermsFor's.
func scratchTermsCuDNN(s compute.ForwardShape, grouped, sums bool) (layers, head int64) {
	n, kv := int64(s.Tokens), int64(s.KVHeads)
	if kv <= 0 {
		kv = int64(s.Heads)
	}
	attn := 2*n*(2*int64(s.Heads)+2*kv)*int64(s.HeadDim) + 4*n*int64(s.Heads) + 16*(n+4)
	layers, head = forwardScratchTermsFor(s, grouped, sums)
	return max(layers, attn+16<<10), head
}

func forwardScratchBytes(s compute.ForwardShape) int64 {
	layers, head := forwardScratchTermsFor(s, true, true)
	return max(layers, head)
}

// forwardScratchTermsFor is forwardScratchBytes by term (ForwardScratchTerms)
// for this package's own attention kernels; grouped: an FP8 MoE's experts
// on the device's grouping (moeScratchBytes); sums: an FP8 MatMul's slab
// holds its fp32 sums (k_fp8_scale's path, fp8.go), not only its codes.
func forwardScratchTermsFor(s compute.ForwardShape, grouped, sums bool) (layers, head int64) {
	n := int64(s.Tokens)
	widest := int64(max(s.Hidden, s.Heads*s.HeadDim, s.Intermediate))
	kv := int64(s.KVHeads)
	if kv <= 0 {
		kv = int64(s.Heads)
	}
	layers = max(2*n*widest, 2*n*(int64(s.Heads)+2*kv)*int64(s.HeadDim)+4*(n+1))
	if s.FP8 { // matMulFP8's slab: its rows' codes (k), scale and fp32 sums (4n), the largest (n, k) of the Linears
		H, Q, I := int64(s.Hidden), int64(s.Heads*s.HeadDim), int64(s.Intermediate)
		f := int64(4)
		if !sums {
			f = 0
		}
		layers = max(layers, int64(min(s.Tokens, fp8SlabRows))*(4+max(H+f*Q, Q+f*H, H+f*I, I+f*H)))
	}
	if s.Experts > 0 {
		layers = max(layers, moeScratchBytes(s.Tokens, s.Hidden, s.MoEIntermediate, s.Experts, s.TopK, s.FP8, grouped))
	}
	// The pool rounds each allocation up; a call makes at most a dozen.
	layers += 16 << 10
	if s.NoHead {
		return layers, 0
	}
	if p, err := planLMHead(s.Tokens, s.Hidden, s.Vocab, max(1, s.K)); err == nil {
		head = p.scratch
	}
	if s.Draws > 0 { // LMHeadSample: its slabs' draws scratch beside the tile
		if p, err := planLMHeadSample(s.Tokens, s.Hidden, s.Vocab, s.K, s.Draws); err == nil {
			head = max(head, p.scratch)
		}
	}
	return layers, head + 16<<10
}
