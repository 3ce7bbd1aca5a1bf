// Package compute holds the backend contract that the models run on, and the
// dtype helpers shared by every backend (BF16, F16, and the NVFP4 pieces
// E2M1 and E4M3).
//
// # The contract
//
// A Backend owns memory (Tensor handles) and runs the few kernels that the
// decoder (package model/decoder) calls, for the teacher's forward and for
// the student's training step:
//
//   - memory: tensors, views of one arena, zero, copy, upload, download;
//   - forward: a GEMM against a weight matrix, embedding gather, RMSNorm,
//     RoPE, packed causal attention, SwiGLU, residual add, the Qwen3-MoE
//     expert FFN and the streaming LM-head top-k (and its variant that also
//     draws samples from the softmax); RMSNorm and attention can
//     save the statistics their backward needs (rstd, log-sum-exp);
//   - backward: one per layer kernel (MatMul, Embed, RMSNorm, RoPE,
//     Attention, SwiGLU, MoE: MoEForward saves what MoEBackward needs,
//     and MoERouting keeps the routing statistics of the load-balancing
//     loss and computes its gradient);
//   - the fused LM-head loss, forward and backward (LossHeadForward,
//     LossHeadBackward: the logits exist one vocabulary tile at a time);
//   - the optimizer: the AdamW update, the gradient sum of squares (global
//     norm, NaN check) and scaling;
//   - NVFP4 quantization-aware training: absmax and fake quantization.
//
// Nothing else: architectures are assembled from these in the decoder,
// which never learns which backend runs.
//
// The contract is written so that a device backend (CUDA) can keep every
// tensor resident on the device and enqueue kernels without synchronizing
// with the host:
//
//   - Kernels take Tensors and integer shapes, never host slices of data.
//     Per-batch integer metadata (token ids, positions, sample offsets) is
//     uploaded once as I32 tensors.
//   - Kernels may run asynchronously in issue order. Only the methods that
//     return host values synchronize: Read*, SumSquares, AbsMax,
//     LossHeadForward, LossValues.Read and MoERoutingValues.Read. They
//     return after every kernel issued before them has finished (the
//     last two: every kernel their values depend on).
//   - Outputs never alias inputs unless a method says so (RoPE,
//     RoPEBackward and Add work in place by design).
//   - A Tensor belongs to the backend that made it; passing it to another
//     backend panics.
//
// Shapes are row-major and given in comments as (rows, cols).
//
// # Activation dtype
//
// A backend chooses the element type of the activations (ActDType): F32
// on the CPU backend, BF16 on the CUDA backend (half the bytes to store
// and to move, and no rounding pass before each GEMM or attention call).
// The decoder stores in it the tensors that feed GEMMs, attention and the
// elementwise kernels: the norms' outputs, q, k, v, the attention output,
// the MLP's gate, up and h, and their NVFP4 fake-quantized copies. It
// keeps in F32 the residual stream, the statistics (rstd, lse), the
// RoPE tables, every gradient, and the input of an MoE block (its router
// runs in fp32). The operands that may be in the activation dtype are
// marked "(act)" below. A backend computes in fp32 whatever they hold and
// rounds each element once when it stores it; a backend whose ActDType
// is F32 may refuse BF16 there.
//
// The gradients that only feed a GEMM's backward may be in the
// activation dtype too (MatMulBackward's dout is (act)): their producers
// round once what they would have stored in F32 (SwiGLUBackward's dgate
// and dup, RMSNormBackward's dx, AttentionBackward's dv, and the BF16
// copy of the residual stream's gradient that ActGrads'
// RMSNormBackwardCopy writes beside it), so a GEMM reads the same BF16
// bits as from a rounding pass of the F32 gradient, without the pass. So
// may attention's dout, which only AttentionBackward reads (a backend
// that runs it on BF16 operands rounds an F32 one anyway): o_proj's
// MatMulBackward writes it as its (act) dx. A
// backward kernel's (act) gradient output accumulates in fp32 and rounds
// the sum once (+=, as every gradient). A gradient that is also needed
// unrounded stays F32: the residual stream's (it keeps accumulating), a
// bias's dout (its column sums), an MoE block's dout, the gradients
// RoPEBackward rotates (dq, dk). The decoder asks GradDType which dtype
// to use; the CPU backend keeps F32.
//
// Two rules say what a kernel does to its outputs, and every method states
// which applies:
//
//   - Forward kernels OVERWRITE (=) their outputs.
//   - Backward kernels ACCUMULATE (+=) into every gradient they produce,
//     for parameters and inputs alike (as llm.c does). A tensor read by two
//     consumers (the residual stream, the shared input of q/k/v, a tied
//     embedding) gets the sum of both contributions for free; the caller
//     zeroes a gradient arena with one Zero before a backward pass.
//     RoPEBackward is the one exception: it rotates its gradient in place.
//
// # FP8 weights (W8A8)
//
// A teacher may hold its decoder blocks' Linear weights in FP8 E4M3
// (FP8Weights; the embedding, norms, MoE routers and LM head stay as
// Weight loads them). A weight matrix w (n,k) (n outputs, k inputs) is
// quantized once, at load, per output channel (row j):
//
//	s_j     = amax_j / 448              amax_j = max_c |w[j,c]|; s_j = 1 when amax_j = 0
//	code    = E4M3(w[j,c] / s_j)        round to nearest even, saturating at ±448
//	deq(w)  = E4M3Value(code) · s_j
//
// MatMul's input x (m,k) is quantized the same way per row (token),
// dynamically, on every call: t_i = amax_i/448 (1 when amax_i = 0),
// deq(x)[i,c] = E4M3(x[i,c]/t_i)·t_i; likewise an MoE expert's input
// rows (the gate/up input and the down input). Then
//
//	out[i,j] = Σ_c deq(x)[i,c] · deq(w)[j,c]  (+ bias[j])
//
// accumulated in fp32, a BF16 out rounded once at the end. Every scale,
// division, product and E4M3 rounding is one fp32 operation, so both
// quantizations give the same codes on every backend; only the order of
// the fp32 accumulation may differ, and where the scales multiply (the
// values before the sum, or t_i·s_j the sum of the codes' products after
// it: the same in exact arithmetic). The CPU backend multiplies the
// dequantized values (SGEMM); the CUDA backend multiplies the codes on
// FP8 tensor cores (cuBLASLt) and scales each fp32 sum in an epilogue
// kernel. A per-row scale makes 448 each row's largest magnitude: no
// element saturates, and each keeps 3 mantissa bits (2^-4 relative;
// below 2^-6 of the scale, the subnormals, 2^-10 of the scale
// absolute). Backward kernels refuse FP8 weights: they are the
// teacher's.
//
// The CPU backend (package compute/cpu) is the reference: every other backend
// is tested against float64 formulas and finite differences by the same
// conformance suite (package compute/computetest), with tolerances of its
// own, |got-want| <= atol+rtol*|want|.
package compute

import (
	"errors"
	"fmt"
)

// DType is the element type of a Tensor.
type DType uint8

// Element types.
const (
	F32    DType = iota // float32
	BF16                // bfloat16, stored as uint16
	I32                 // int32
	F8E4M3              // float8 E4M3FN: an FP8 weight (FP8Weights), codes with per-row scales
)

// Size is the bytes of one element.
func (d DType) Size() int {
	switch d {
	case BF16:
		return 2
	case F8E4M3:
		return 1 // the code; the per-row scales are beside it
	}
	return 4
}

func (d DType) String() string {
	switch d {
	case F32:
		return "f32"
	case BF16:
		return "bf16"
	case I32:
		return "i32"
	case F8E4M3:
		return "f8e4m3"
	}
	return fmt.Sprintf("dtype(%d)", uint8(d))
}

// Tensor is a handle to a flat buffer owned by one Backend.
type Tensor interface {
	DType() DType
	Len() int // elements
}

// Backend is the set of kernels the models call. See the package doc for the
// synchronization, aliasing and overwrite/accumulate rules.
type Backend interface {
	// Name is "cpu" or "cuda".
	Name() string
	// ActDType is the element type the backend wants activations in (see
	// the package doc): F32 or BF16.
	ActDType() DType

	// --- Memory.

	// New returns a zeroed tensor of n elements.
	New(dt DType, n int) Tensor
	// FromF32 uploads host data as a new F32 tensor.
	FromF32(src []float32) Tensor
	// FromI32 uploads host data as a new I32 tensor.
	FromI32(src []int32) Tensor
	// Weight uploads a weight matrix given in BF16 or F32 host form; the
	// backend picks its storage (the CPU backend widens BF16 to F32, a GPU
	// backend keeps BF16 for its GEMMs). src is []uint16 (BF16) or []float32.
	Weight(src any) (Tensor, error)
	// View returns elements [off, off+n) of t as a tensor that shares t's
	// memory: parameters, gradients and activations are views carved out
	// of a few arenas. A view is valid while t is; freeing a view is a
	// no-op.
	View(t Tensor, off, n int) Tensor
	// Zero sets every element of t to 0.
	Zero(t Tensor)
	// Copy: dst[0:src.Len()) = src, same dtype; they must not overlap.
	Copy(dst, src Tensor)
	// WriteF32 copies host data into t[0:len(src)) (t is F32, or on a
	// backend whose ActDType is BF16 also BF16: rounded to nearest even).
	WriteF32(t Tensor, src []float32)
	// ReadF32 and ReadI32 copy t[0:len(dst)) to the host, after all issued
	// work (ReadF32 widens a BF16 t).
	ReadF32(t Tensor, dst []float32)
	ReadI32(t Tensor, dst []int32)
	// Free releases a tensor; using it (or a view of it) afterwards is an
	// error.
	Free(t Tensor)

	// --- Forward kernels (=).

	// MatMul: x (m,k) (act), w (n,k), bias (n) or nil -> out (m,n) (act)
	// = x·wᵀ + bias. This is the layout of torch.nn.Linear weights. A BF16
	// out is the fp32 result (bias included) rounded once.
	MatMul(out, x, w, bias Tensor, m, n, k int)
	// Embed: table (vocab,dim), ids (n) I32 -> out (n,dim). Ids are
	// trusted: callers validate them against the vocabulary.
	Embed(out, table, ids Tensor, n, dim int)
	// RMSNorm: x (rows,dim) (act), w (dim) -> out (rows,dim) (act), in fp32 (HF's
	// LlamaRMSNorm): out = x·rstd·w, rstd = 1/sqrt(mean(x²)+eps), the mean
	// of squares accumulated in float64 and rounded to fp32. rstd (rows)
	// receives the statistics for the backward, or is nil. out may alias x.
	RMSNorm(out, rstd, x, w Tensor, rows, dim int, eps float32)
	// RoPE rotates x (tokens, heads, headDim) (act) in place, rotate-half
	// convention (HF apply_rotary_pos_emb): for i < headDim/2, with
	// c, s = cos, sin (tokens, headDim/2) at the token,
	// x[i], x[i+hd/2] = x[i]·c - x[i+hd/2]·s, x[i+hd/2]·c + x[i]·s.
	RoPE(x, cos, sin Tensor, tokens, heads, headDim int)
	// RMSNormRoPE is RMSNorm over each head of x followed by RoPE, in one
	// pass where the backend fuses them (Qwen3's q/k norm): x (tokens,
	// heads, headDim) (act), w (headDim) -> out (tokens, heads, headDim)
	// (act) = RoPE(RMSNorm(x, w)) with RMSNorm's rows = tokens·heads and
	// RoPE's cos, sin as RoPE takes them; rstd (tokens·heads) or nil
	// receives RMSNorm's statistics. out may alias x. Bit for bit RMSNorm
	// then RoPE on an fp32 backend; a BF16 out is rounded once, after the
	// rotation.
	RMSNormRoPE(out, rstd, x, w, cos, sin Tensor, tokens, heads, headDim int, eps float32)
	// Attention: packed variable-length causal attention with GQA.
	// q (tokens, nHead, hd), k and v (tokens, nKV, hd), all (act); the samples are the
	// token ranges [starts[i], starts[i+1]) of starts (nSeq+1) I32, which
	// cover the tokens (starts[0] = 0, starts[nSeq] = tokens); a token
	// attends to itself and earlier tokens of its own sample only; query
	// head h reads kv head h/(nHead/nKV). out (tokens, nHead, hd) (act). maxLen
	// is the longest sample. lse (tokens, nHead) receives the log-sum-exp
	// of each query row's scaled scores, for the backward, or is nil.
	Attention(out, lse, q, k, v, starts Tensor, nSeq, maxLen, tokens, nHead, nKV, hd int, scale float32)
	// SwiGLU: out (n) = silu(gate)·up, all three (act). out may alias gate
	// (of the same dtype).
	SwiGLU(out, gate, up Tensor, n int)
	// Add: a (n) += b (n), the residual connection; b is F32, a F32 or
	// (act) (a LoRA adapter's term into its Linear's output: a BF16 a is
	// rounded once after the sum).
	Add(a, b Tensor, n int)
	// Dropout: x (rows, cols) (act) -> out (rows, cols) (act) =
	// x·d.Scale where d keeps the element (DropoutMask.Keep, row r the
	// r-th row of x), 0 elsewhere: inverted dropout with a mask every
	// backend draws alike (a LoRA adapter's lora_dropout). The product is
	// fp32; a BF16 out is rounded once. out must not alias x.
	Dropout(out, x Tensor, d *DropoutMask, rows, cols int)
	// AddRMSNorm is Add then RMSNorm of the sum, in one pass where the
	// backend fuses them (the residual connection and the next norm):
	// a (rows,dim) += b (rows,dim), both F32; out (rows,dim) (act) =
	// RMSNorm(a) with w (dim), rstd (rows) or nil, bit for bit Add
	// followed by RMSNorm. out must not alias a or b.
	AddRMSNorm(out, rstd, a, b, w Tensor, rows, dim int, eps float32)
	// MoE runs a Qwen3-MoE sparse FFN: router logits = x·routerᵀ, softmax
	// over experts in fp32, top-k experts per token (renormalized when
	// m.NormTopK), each expert a SwiGLU MLP, outputs summed with the
	// routing weights. x (tokens, hidden) -> out (tokens, hidden).
	MoE(out, x Tensor, m *MoEWeights, tokens int)
	// MoEForward is MoE for training: the same output, and s (sized by
	// NewMoESaved) receives what MoEBackward needs: the router
	// probabilities, the top-k choice and routing weights, the grouping of
	// the (token, slot) pairs by expert, and each expert's projections and
	// output over its rows. Like MoE it computes the experts by grouping:
	// the pairs sorted by expert (stable: ascending token within an
	// expert), one GEMM per expert over its contiguous rows, the outputs
	// scattered back. Under NVFP4 QAD (m.InAmax > 0, m.HAmax > 0) the
	// experts' inputs are fake-quantized, the router's are not.
	MoEForward(out, x Tensor, m *MoEWeights, s *MoESaved, tokens int)
	// LMHeadTopK: x (tokens, hidden) (act), w (vocab, hidden). For each token it
	// computes the logits over the whole vocabulary in tiles, keeping a
	// running top-k and log-sum-exp, and writes ids (tokens,k) I32 sorted
	// by descending logit (ties: lower id first) and logprobs (tokens,k) F32
	// = logit - logsumexp(all logits). [tokens x vocab] is never held.
	LMHeadTopK(ids, logprobs, x, w Tensor, tokens, hidden, vocab, k int)
	// LMHeadSample is LMHeadTopK (k 0: no top-k; ids and logprobs then
	// hold nothing) that also draws n ids per token from its softmax, in
	// the same pass over the vocabulary tiles: [tokens x vocab] is never
	// held, and only the few vocabulary blocks the draws land in are
	// multiplied again. u (tokens, n, 2) I32 holds each token's uniforms
	// in [0, 1), ascending, as PackUniforms writes them. Draw d of a
	// token is the smallest id v (outside the top-k when head, which
	// needs k >= 1) whose cumulative probability Σ_{w<=v} p_w, ids
	// ascending, exceeds u_d times the mass drawn from (1, or the mass
	// outside the top-k); a u so close to 1 that rounding leaves it above
	// the sum draws the last id with mass. drawn (tokens, n) I32 receives
	// the draws in the order of the uniforms (so ascending); a token with
	// no mass to draw from (head, and the top-k holds it all) gets -1s.
	// tail (tokens) F32 receives the mass drawn from, Σ_{v∉top-k} p_v
	// under head (else Σ_v p_v = 1 to rounding). ids and logprobs are
	// LMHeadTopK's. The probabilities are those of the fp32 logits,
	// computed to about 1e-6 relative (the backend's exp and logits):
	// ids agree with a float64 inverse CDF wherever no threshold lies
	// that close to a step of the CDF. An id more than 87 nats below the
	// largest logit of its vocabulary tile (2048 or more ids) may count as
	// mass 0 (the range of a float32 exp).
	LMHeadSample(ids, logprobs, drawn, tail, x, w, u Tensor, tokens, hidden, vocab, k, n int, head bool)

	// --- Backward kernels (+=; dX is the gradient of the loss w.r.t. X).

	// MatMulBackward of out = x·wᵀ + bias: dout (m,n) (act), x (m,k) (act), w (n,k) ->
	// dx (m,k) (act) += dout·w, dw (n,k) += doutᵀ·x, dbias (n) += Σ_rows dout
	// (a BF16 dx gets each fp32 sum rounded once).
	// dx, dw and dbias may be nil (not needed: a frozen weight, as a LoRA
	// student's base, has no dw; x is then not read). x and w must be what the
	// forward multiplied (under NVFP4 fake quantization, the quantized
	// copies: the straight-through estimator). A BF16 dout is read as is
	// by a backend that rounds its GEMM operands (the same bits as an F32
	// dout it would round); it needs a nil dbias (the column sums read
	// the F32 gradient: a backend panics otherwise).
	MatMulBackward(dx, dw, dbias, dout, x, w Tensor, m, n, k int)
	// EmbedBackward: dout (n,dim), ids (n) -> dtable (vocab,dim) +=, each
	// row of dout added to the row of its id.
	EmbedBackward(dtable, dout, ids Tensor, n, dim int)
	// RMSNormBackward: dout, x (rows,dim) (x: act), w (dim), rstd (rows) saved by
	// the forward -> dx (rows,dim) (act) +=, dw (dim) +=. With xh = x·rstd:
	// dw += Σ_rows dout·xh; dx += rstd·(dout·w - xh·mean(dout·w·xh)).
	// dx must not alias dout. A BF16 dx (the q/k norm's input gradient,
	// which only a GEMM's backward reads) gets each fp32 sum rounded once.
	RMSNormBackward(dx, dw, dout, x, w, rstd Tensor, rows, dim int)
	// RoPEBackward turns dout (tokens, heads, headDim) into dx in place:
	// the rotation is orthogonal, so its backward is the rotation by
	// -angle. It overwrites, the one exception to +=.
	RoPEBackward(dx, cos, sin Tensor, tokens, heads, headDim int)
	// AttentionBackward: dout (tokens,nHead,hd) (act), q, k, v (act), starts and
	// lse as in the forward, out (tokens,nHead,hd) (act) the forward's
	// output -> dq
	// (tokens,nHead,hd) +=, dk (tokens,nKV,hd) +=, dv (tokens,nKV,hd)
	// (act) += (a BF16 dv gets each fp32 sum rounded once; dq and dk are
	// F32: RoPEBackward rotates them). The probabilities
	// are recomputed from lse, never stored; out gives the softmax
	// backward's row term Σ dout·out without recomputing the forward (a
	// backend may ignore it and compute the term from P).
	AttentionBackward(dq, dk, dv, dout, q, k, v, out, lse, starts Tensor, nSeq, maxLen, tokens, nHead, nKV, hd int, scale float32)
	// SwiGLUBackward: dout, gate, up (n) (gate, up: act) -> dgate (n) (act) +=,
	// dup (n) (act) +=, with silu'(g) = σ(g)·(1 + g·(1-σ(g))); a BF16
	// dgate or dup gets each fp32 sum rounded once.
	SwiGLUBackward(dgate, dup, dout, gate, up Tensor, n int)
	// MoEBackward of MoEForward: dout (tokens,hidden), x, m and s as the
	// forward left them -> dx (tokens,hidden) +=, and in dm (the weights'
	// layout, gradients in place of weights) dm.Router += , dm.Gate[e],
	// dm.Up[e], dm.Down[e] +=. The gradient reaches x through the experts
	// and through the router: routing weight w = p_e (or p_e/Σ_topk p
	// under NormTopK), p = softmax(x·routerᵀ). dprob (numExperts) F32 or
	// nil is an extra gradient of the loss w.r.t. every router
	// probability p[t,e], the same for every token t (the load-balancing
	// loss's, see MoEAuxGrad), added before the softmax backward. Under
	// QAD the backward is straight-through: the experts' weight gradients
	// use the quantized inputs, and dx gets the gradient of the quantized
	// input as that of x. The top-k choice is piecewise constant: it has
	// no gradient. dm nil: the block is frozen (a LoRA student's base):
	// dx alone, no weight gradient of the router or any expert (their
	// GEMMs are skipped), the same dx bit for bit.
	MoEBackward(dx Tensor, dm *MoEWeights, dout, x Tensor, m *MoEWeights, s *MoESaved, dprob Tensor, tokens int)
	// NewMoERouting returns the routing statistics of layers MoE layers
	// of numExperts experts each, zeroed, kept where the kernels run
	// (device memory on a GPU): see MoERouting.
	NewMoERouting(layers, numExperts int) MoERouting

	// DropoutBackward of Dropout: dout (rows, cols) F32 -> dx (rows,
	// cols) F32 += dout·d.Scale where d keeps the element (nothing
	// elsewhere). The mask is drawn again, never stored.
	DropoutBackward(dx, dout Tensor, d *DropoutMask, rows, cols int)

	// --- Optimizer.

	// AdamW applies one torch.optim.AdamW update to p (n) with gradient g
	// and moments m, v (n), all F32, in place (see AdamWStep).
	AdamW(p, g, m, v Tensor, n int, s AdamWStep)
	// SumSquares returns Σ x² over x[0:n) accumulated in float64 (the
	// squared global gradient norm; NaN or Inf in x make it NaN or Inf).
	// It synchronizes.
	SumSquares(x Tensor, n int) float64
	// Scale: x (n) *= c (gradient clipping).
	Scale(x Tensor, n int, c float32)

	// --- NVFP4 quantization-aware training.

	// AbsMax returns max |x| over x[0:n) (act) (calibration). It
	// synchronizes.
	AbsMax(x Tensor, n int) float32
	// FakeQuantNVFP4: src (rows,cols) (act) -> dst (rows,cols) (act), NVFP4 fake
	// quantization with the per-tensor amax, 16-element blocks along each
	// row, exactly as NVFP4FakeQuant defines it. dst may alias src. Its
	// backward is the identity (straight-through): callers use dst as the
	// forward input and its gradient as the gradient of src.
	FakeQuantNVFP4(dst, src Tensor, rows, cols int, amax float32)

	// --- Fused LM-head loss (see LossHead for the definitions).

	// LossHeadForward is pass 1: the logits z = x·wᵀ of the counted
	// positions, one vocabulary tile at a time, reduced to each position's
	// statistics. It synchronizes.
	LossHeadForward(h *LossHead) LossStats
	// LossHeadBackward is pass 2: it recomputes the logits tile by tile
	// (or reads the ones pass 1 kept: LossHead.Keep),
	// turns them into dL/dz with c, and accumulates dx (N,C) += dz·w at the
	// counted rows and dw (V,C) += dzᵀ·x. A nil dw is a frozen LM head
	// (a LoRA student's): no weight gradient is made, and dx is the same.
	LossHeadBackward(h *LossHead, c *LossCoef, dx, dw Tensor)
}

// LossHead is one call of the fused LM-head loss kernels over the M
// counted positions of a packed batch. [M x V] logits are never held: a
// backend holds M x TileCols of them at a time.
type LossHead struct {
	X, W       Tensor // (N,C) final hidden states (act), (V,C) LM head
	Rows       Tensor // (M) I32: the counted positions, rows of X
	Labels     Tensor // (M) I32: each position's label id
	TopIDs     Tensor // (M,K) I32: each position's teacher ids, ascending, distinct; nil when K = 0
	M, C, V, K int
	// InvT is 1/T, the KD temperature's inverse; the CE statistics are
	// untempered.
	InvT float32
	// TileCols is the vocabulary tile width; 0 lets the backend choose.
	TileCols int
	// Keep says that the caller's next loss-head call is LossHeadBackward
	// with this same h, X and W unchanged (a training step's): a backend
	// may keep pass 1's logits, all M x V of them, for pass 2 instead of
	// computing them again (compute/cuda, in fp32: the same bits). The
	// caller has the memory for them planned (train.PlanShape.KeepLogits).
	Keep bool
}

// LossStats are pass 1's statistics of each counted position, with
// z = x·wᵀ its logits over the whole vocabulary:
//
//	LseT = logsumexp_v(z_v·InvT)
//	Lse1 = logsumexp_v(z_v)                  (= LseT when InvT = 1)
//	Tail = Σ_{v∉K} exp(z_v·InvT - LseT)      summed directly over v outside
//	                                         TopIDs, never as 1 - Σ_K, so it
//	                                         keeps its digits when K holds
//	                                         all but a sliver of the mass
//	ZK   = z at TopIDs (M,K), ZLab = z at Labels (M)
//
// The sums are accumulated in float64.
type LossStats struct {
	LseT, Lse1, Tail []float64
	ZK, ZLab         []float32
}

// LossCoef are the coefficients of pass 2: for counted position r, with
// q_v = exp(z_v·InvT - LseT[r]) and p_v = exp(z_v - Lse1[r]),
//
//	dL/dz_v = A[r]·q_v       (v ∉ TopIDs[r])
//	        = CK[r,j]        (v = TopIDs[r,j])
//	        + WSFT·(p_v - [v = Labels[r]])   for every v (the CE part)
//
// LseT, Lse1, A (M) and CK (M,K) are F32 tensors.
type LossCoef struct {
	LseT, Lse1, A, CK Tensor
	WSFT              float32
}

// DeviceLossCoef is implemented by backends that compute pass 2's
// coefficients on the device from pass 1's statistics, so that pass 2
// follows pass 1 with no round trip through the host (compute/cuda):
// package train/loss otherwise downloads LossStats, computes LossCoef in
// float64 on the host and uploads it, and the device waits meanwhile.
// The device computes what train/loss's host path computes, bit for bit:
// see LossKD for the definition it takes. It covers one teacher's
// top-k with the forward KL under each tail mode, and CE only; every
// other configuration keeps the host path.
type DeviceLossCoef interface {
	// LossHeadForwardKD is pass 1 (LossHeadForward's statistics, kept on
	// the device) followed by pass 2's coefficients: c.LseT, c.Lse1, c.A
	// (M) and, with K > 0, c.CK (M,K), F32 tensors of the caller, are
	// overwritten (c.WSFT is not read). kd is the KD term; nil (with
	// h.K = 0) is CE only: A = 0 and no divergence. It does not
	// synchronize; the result reads each position's loss values later.
	LossHeadForwardKD(h *LossHead, kd *LossKD, c *LossCoef) LossValues
}

// LossValues are the loss values of the counted positions of one
// LossHeadForwardKD, left on the device: the host needs them for its
// logs only, so it reads them after it has issued pass 2 (the trainer:
// after the whole step, train.PendingStats).
type LossValues interface {
	// Read writes each position's divergence D (0 without a KD term) and
	// cross-entropy Lse1 - z_label to d and ce (M each), once the work
	// that computed them has finished (it waits for that work, and may
	// return before work issued after it: the CUDA backend copies them
	// to pinned host memory behind an event), and releases the device's
	// copy. Call it exactly once.
	Read(d, ce []float64)
}

// LossTail is a LossKD's tail mode (train/loss's tail modes, which its
// package doc defines).
type LossTail int32

// The tail modes.
const (
	TailBucket LossTail = iota
	TailRenormalize
	TailZero
)

// LossKD is one teacher's forward-KL term for LossHeadForwardKD. With, at
// counted position r, z_c the logit at column c of TopIDs[r] (ZK), lseT,
// lse1 and tail the statistics of LossStats, invT = float64(InvT), l_c =
// float64(LP[r,c]) and the columns visited in the teacher's rank order
// c_j = Col[r,j], j = 0..K-1 (every sum below runs in that order, from
// 0), all in float64 with each operation rounded once (no fused
// multiply-add) and exp, log = compute.Exp, compute.Log:
//
//	bucket:      p_c = l_c,  lq_c = z_c·invT - lseT,
//	             lpT = log(max(1 - Σ_j exp(p_cj), 1e-30)), lqT = log(max(tail, 1e-30))
//	renormalize: p_c = l_c·LPScale - lsp, lsp = mp + log Σ_j exp(l_cj·LPScale - mp),
//	             mp = max_j l_cj·LPScale (math.Max); lq_c = z_c·invT - lsq, lsq
//	             the same over z_cj·invT
//	zero:        p_c as renormalize, lq_c as bucket
//
// and, with P_c = exp(p_c) and the bucket's entry e = T after the K
// columns (P_T = exp(lpT)):
//
//	D   = Σ_e [P_e > 0]·P_e·(p_e - lq_e)         (sum of the products)
//	H   = Σ_e -P_e
//	out = -H (zero), 0 (renormalize), -H + (-P_T)/tail (bucket, when
//	      tail > 1e-30; else -H)
//	A   = float32(max(-1e30, min(1e30, Scale·out)))
//	CK[r,c] = float32(Scale·(-P_c - exp(lq_c)·H))
//
// These are train/loss's definitions (kdMath.term, coefK, clampCoef) in
// its order of operations; its tests hold the device to them bit for bit.
type LossKD struct {
	Tail LossTail
	// LP (M,K) F32: the teacher's log-probs, column c of row r that of
	// the id TopIDs[r,c].
	LP Tensor
	// Col (M,K) I32: Col[r,j] is the column of TopIDs[r] that holds the
	// teacher's rank-j id; the sums run in rank order.
	Col Tensor
	// LPScale is Tc/T, the teacher's capture temperature over the KD
	// temperature (renormalize and zero).
	LPScale float64
	// Scale multiplies the coefficients: the KD weight (times T² under
	// scale_t2) over the normalizer, times float64(InvT).
	Scale float64
}

// MoEWeights are the tensors of one Qwen3-MoE sparse block.
type MoEWeights struct {
	Router           Tensor   // (numExperts, hidden)
	Gate, Up, Down   []Tensor // per expert: (inter,hidden), (inter,hidden), (hidden,inter)
	NumExperts, TopK int
	Hidden, Inter    int
	NormTopK         bool
	// InAmax and HAmax, when positive, switch on NVFP4 fake quantization
	// (FakeQuantNVFP4 with this per-tensor amax) of the experts' inputs:
	// x as gate_proj and up_proj read it, and silu(gate)·up as down_proj
	// reads it. One amax serves every expert of the block (the maximum
	// over the experts, which is what deployments load into fused MoE
	// kernels). The router always reads x unquantized. 0: off.
	InAmax, HAmax float32
	// Adapters, when not nil, are LoRA adapters on the experts'
	// projections (a LoRA student's experts: PEFT's
	// mlp.experts.E.{gate,up,down}_proj): Adapters[e] is expert e's, any of
	// its three nil for none. Each adds its term over the expert's grouped
	// rows as compute.LoRA defines it: gate = xg·Gateᵀ +
	// Scale·(drop(xg)·Aᵀ)·Bᵀ (up likewise), y = h·Downᵀ +
	// Scale·(drop(h)·Aᵀ)·Bᵀ, h = silu(gate)·up; MoEForward saves Gate, Up
	// and Y with the terms in. MoEBackward accumulates each adapter's DA and
	// DB (dm nil or not: the base may be frozen) and its part of dx. Not
	// with FP8 experts or QAD (InAmax, HAmax).
	Adapters []MoEAdapter
	// Drop, when not nil, keys the adapters' dropout (LoRA.Dropout > 0) in
	// MoEForward and MoEBackward: the mask of adapter l is
	// NewDropoutMask(l.Stream, Drop.Step, Drop.Row, l.Dropout) over (token,
	// column) of its input, the token the grouped row's (so a token's
	// mask does not depend on the other tokens' routing). nil: no
	// dropout (an evaluation; MoE never drops).
	Drop *MoEDrop
}

// MoEAdapter are one expert's LoRA adapters (nil: none).
type MoEAdapter struct{ Gate, Up, Down *LoRA }

// MoEDrop is a training row's place (DropoutMask's Step and Row).
type MoEDrop struct{ Step, Row uint32 }

// MoESaved are the tensors MoEForward fills for MoEBackward, for a batch of
// T tokens with E experts and top-k K; rows "in grouped order" are the T·K
// (token, slot) pairs sorted by expert, expert e owning rows
// [Offsets[e], Offsets[e+1]).
type MoESaved struct {
	Probs   Tensor // (T,E) F32: softmax of the router logits, fp32
	Sel     Tensor // (T,K) I32: the chosen experts, descending probability (ties: lower index)
	Wts     Tensor // (T,K) F32: their routing weights (renormalized under NormTopK)
	Order   Tensor // (T·K) I32: the pair t·K+j of each grouped row
	Offsets Tensor // (E+1) I32: expert e's grouped rows start at Offsets[e]
	Gate    Tensor // (T·K, inter) F32, grouped: gate_proj outputs
	Up      Tensor // (T·K, inter) F32, grouped: up_proj outputs
	Y       Tensor // (T·K, hidden) F32, grouped: each expert's output before its routing weight
}

// NewMoESaved carves the MoESaved of T tokens out of farena (F32) and
// iarena (I32), of the sizes MoESavedSizes returns.
func NewMoESaved(be Backend, farena, iarena Tensor, T, E, K, hidden, inter int) *MoESaved {
	fo, io := 0, 0
	f := func(n int) Tensor { fo += n; return be.View(farena, fo-n, n) }
	i := func(n int) Tensor { io += n; return be.View(iarena, io-n, n) }
	return &MoESaved{Probs: f(T * E), Sel: i(T * K), Wts: f(T * K), Order: i(T * K), Offsets: i(E + 1),
		Gate: f(T * K * inter), Up: f(T * K * inter), Y: f(T * K * hidden)}
}

// MoESavedSizes returns the F32 and I32 element counts NewMoESaved carves.
func MoESavedSizes(T, E, K, hidden, inter int) (f32, i32 int) {
	return T*E + T*K + 2*T*K*inter + T*K*hidden, 2*T*K + E + 1
}

// MoEAuxGrad is the gradient of coef·aux w.r.t. each router probability
// p[t,e] of one MoE layer, where aux is the load-balancing loss of HF's
// Qwen3-MoE (load_balancing_loss_func, with every token counted):
//
//	aux = E · Σ_e f_e · P_e,  f_e = count_e / (L·T),  P_e = Σ_{l,t} p[l,t,e] / (L·T)
//
// with the L MoE layers' T tokens each pooled (HF concatenates the
// layers' router logits) and count_e the number of (layer, token, slot)
// choices of expert e. The counts are piecewise constant, so
// d aux/d p[l,t,e] = E·f_e/(L·T), the same for every layer and token.
func MoEAuxGrad(coef float64, counts []int, L, T int) []float32 {
	E := len(counts)
	n := float64(L * T)
	g := make([]float32, E)
	for e, c := range counts {
		g[e] = float32(coef * float64(E) * float64(c) / n / n)
	}
	return g
}

// MoERouting are the routing statistics of one batch's MoE layers
// (Backend.NewMoERouting), per layer l and expert e: count[l][e], the
// (token, slot) choices of e, and sum[l][e] = Σ_t p[t,e], the column sum
// of the router probabilities in float64, t ascending (one order, so
// every backend and the host get the same bits). The load-balancing
// loss is a function of them: its value (the logs) and its gradient
// (MoEAuxGrad). A device backend keeps them on the device: recording
// them and computing the gradient read nothing back to the host, and
// the host reads them (Later) once the work that needs them is issued.
// None of the methods synchronizes.
type MoERouting interface {
	// Record overwrites layer l's statistics (0 <= l < layers) with
	// those of the routing that MoEForward saved in s for tokens tokens:
	// count[l][e] = s.Offsets[e+1] - s.Offsets[e] and sum[l][e] =
	// Σ_t s.Probs[t,e]. Call it before anything overwrites s.
	Record(l int, s *MoESaved, tokens int)
	// AuxGrad writes dprob (numExperts) F32 (=) with MoEAuxGrad(coef,
	// counts, layers, tokens), counts[e] = Σ_l count[l][e], bit for bit
	// (its float64 products and quotients in its order, each rounded once
	// to fp32): the load-balancing loss's gradient that MoEBackward
	// takes, from the recorded counts where they are.
	AuxGrad(dprob Tensor, coef float64, tokens int)
	// Later snapshots the statistics recorded so far for the host, after
	// the work issued before it, without waiting: Record may overwrite
	// them (the next batch) before the snapshot is read.
	Later() MoERoutingValues
	// Free releases the statistics; a snapshot stays readable.
	Free()
}

// MoERoutingValues are a snapshot of MoERouting (Later).
type MoERoutingValues interface {
	// Read writes layer l's counts and sums to counts[l] and sums[l]
	// (numExperts each, for each of the layers), once the work that
	// computed them has finished: it waits for that work only (the CUDA
	// backend copies them to pinned host memory behind an event, as
	// LossValues), and releases the snapshot. Call it exactly once.
	Read(counts [][]int, sums [][]float64)
}

// AdamWStep is one AdamW update's scalars, in fp32, as torch.optim.AdamW
// (non-amsgrad) computes them at step t with learning rate lr:
//
//	p ← p·Decay                            Decay = 1 - lr·weight_decay (1: no decay)
//	m ← β1·m + (1-β1)·g ;  v ← β2·v + (1-β2)·g²
//	p ← p - StepSize · m / (sqrt(v)/BC2Sqrt + Eps)
//
// with StepSize = lr/(1-β1ᵗ) and BC2Sqrt = sqrt(1-β2ᵗ).
type AdamWStep struct {
	Beta1, Beta2, Eps float32
	StepSize, BC2Sqrt float32
	Decay             float32
}

// Host is implemented by backends whose tensors are host memory (the CPU
// backend). HostF32 returns an F32 tensor's elements without a copy; the
// student uses it to expose its parameters and AdamW moments as host
// slices (checkpoints, export) without a download.
type Host interface {
	HostF32(t Tensor) []float32
}

// ActGrads is implemented by backends that take the gradients a GEMM's
// backward reads in their activation dtype (the package doc's rule).
type ActGrads interface {
	// GradDType is the dtype the decoder stores those gradients in: the
	// backend's ActDType, or F32 where an option of the backend keeps
	// every gradient F32 (for comparisons).
	GradDType() DType
	// RMSNormBackwardCopy is RMSNormBackward with an F32 dx that also
	// writes dxc (rows,dim) BF16 = the rounding of each element of dx
	// after the +=, in the same pass: the residual stream's gradient,
	// which keeps accumulating in F32, and its BF16 copy for the next
	// MatMulBackward's dout. dxc must alias neither dx nor dout.
	RMSNormBackwardCopy(dx, dxc, dw, dout, x, w, rstd Tensor, rows, dim int)
	// RoPEBackwardCopy is RoPEBackward that also writes dxc
	// (tokens,heads,headDim) BF16 = the rounding of each element of the
	// rotated dx, in the same pass: q_proj's and k_proj's dout where no
	// q/k norm or bias reads dx after the rotation (Llama's). dxc must not
	// alias dx.
	RoPEBackwardCopy(dx, dxc, cos, sin Tensor, tokens, heads, headDim int)
}

// GradDType is be's ActGrads.GradDType, or F32 for a backend that does not
// implement ActGrads.
func GradDType(be Backend) DType {
	if g, ok := be.(ActGrads); ok {
		return g.GradDType()
	}
	return F32
}

// ScratchReporter is implemented by backends that can bound the scratch
// their kernels allocate beside their outputs (package infer's memory
// bound).
type ScratchReporter interface {
	// AttentionScratchBytes bounds Attention's scratch for samples of at
	// most maxLen tokens.
	AttentionScratchBytes(maxLen int) int64
	// LMHeadScratchBytes bounds LMHeadTopK's scratch for top-k.
	LMHeadScratchBytes(k int) int64
}

// BatchSumSquares is implemented by backends that sum the squares of
// several tensors with one synchronization instead of one each: the
// global gradient norm of a student of hundreds of tensors (optim's
// ClipGradNorm), where one wait per tensor leaves a device idle between
// them.
type BatchSumSquares interface {
	// SumSquaresEach writes SumSquares(xs[i], ns[i]) into out[i], bit
	// for bit what SumSquares returns, and synchronizes once.
	SumSquaresEach(out []float64, xs []Tensor, ns []int)
}

// MultiTensor is implemented by backends that run the optimizer's
// per-tensor updates over many tensors in one launch (torch's fused and
// foreach AdamW, apex's multi_tensor_apply): a student's hundreds of
// parameter tensors, most of them small, otherwise cost a launch each.
// Each method is, bit for bit, its single-tensor operation applied to
// every tensor.
type MultiTensor interface {
	// AdamWEach applies AdamW(ps[i], gs[i], ms[i], vs[i], ns[i], s) to
	// every i, with s.Decay replaced by 1 where decays[i] is false. Where
	// bs (nil, or with nil entries) has a BF16 tensor, the update also
	// writes it, in the same pass, with the rounding to nearest even of
	// each updated element of ps[i] (BF16Rounder's RoundBF16 of it: a
	// sharded student's BF16 whole weights at its rank's part).
	AdamWEach(ps, gs, ms, vs, bs []Tensor, ns []int, decays []bool, s AdamWStep)
	// ScaleEach applies Scale(xs[i], ns[i], c) to every i.
	ScaleEach(xs []Tensor, ns []int, c float32)
	// CopyEach applies Copy(dsts[i], srcs[i]) to every i, F32 tensors
	// (a sharded student's pack of its norms' pieces: hundreds of copies
	// of a few KB, each a launch otherwise).
	CopyEach(dsts, srcs []Tensor)
}

// AttentionWorkspaceReporter is implemented by backends whose attention
// library sizes its own workspace (the CUDA backend's cuDNN), known only
// once the library has planned the shape: memory plans ask for it.
type AttentionWorkspaceReporter interface {
	// AttentionWorkspaceBytes is the most the attention of nSeq samples
	// of at most maxLen tokens allocates beside its tensors and the
	// backend's own copies, forward or backward; 0 when none.
	AttentionWorkspaceBytes(nSeq, maxLen, heads, kvHeads, headDim int) int64
}

// ErrOutOfMemory is what a device backend's out-of-memory error wraps
// (errors.Is), so that a caller above compute/ can say what to change
// without knowing which backend ran out.
var ErrOutOfMemory = errors.New("compute: out of device memory")

// DeviceMemory is implemented by backends whose tensors live in a device
// memory of fixed size (the CUDA backend). A caller checks a forward's size
// against it before the first batch (package infer's CheckDeviceFit), so
// that a token budget too large for the device is an error at start-up
// that names a budget that fits, not an out-of-memory failure mid-fill.
type DeviceMemory interface {
	// MemInfo returns the device's free and total bytes.
	MemInfo() (free, total int64)
	// ForwardScratchBytes bounds what the kernels of one forward of shape
	// s allocate beside their inputs and outputs, at their peak: the
	// largest single call's scratch (each call frees its own before the
	// next call's allocations).
	ForwardScratchBytes(s ForwardShape) int64
}

// ForwardShape is what a forward's kernel scratch depends on: the batch
// (tokens, its longest sample, top-k) and the model's dimensions.
type ForwardShape struct {
	Tokens, MaxLen, K                                    int
	Hidden, Heads, KVHeads, HeadDim, Intermediate, Vocab int
	// Experts > 0: a Qwen3-MoE model with TopK experts per token of
	// MoEIntermediate each.
	Experts, TopK, MoEIntermediate int
	// FP8: the layers' Linear weights are FP8 (FP8Weights): their GEMMs
	// quantize their inputs in scratch.
	FP8 bool
	// Draws > 0: the LM head also draws that many ids a token
	// (LMHeadSample, sampled targets; K is then the head's top-k, 0 for
	// none).
	Draws int
	// NoHead: the forward stops before the LM head (a pipeline stage
	// that hands its residual stream to the next device): no LM-head
	// scratch.
	NoHead bool
}

// Partial is implemented by a backend that does not yet implement every
// method of the contract (none of this module's backends today: the CUDA
// backend used it to refuse Qwen3-MoE students until its MoE training
// kernels existed). Callers ask before they build on it, so that a
// missing kernel is a clear error before anything runs rather than a
// panic mid-step.
type Partial interface {
	// Lacks returns an error naming what is missing for feature, or nil
	// when the backend runs it. Features: FeatureMoETraining.
	Lacks(feature string) error
}

// FeatureMoETraining is MoEForward + MoEBackward: training a Qwen3-MoE
// student.
const FeatureMoETraining = "moe-training"

// Lacks asks be (see Partial); a backend that is not Partial runs
// everything.
func Lacks(be Backend, feature string) error {
	if p, ok := be.(Partial); ok {
		return p.Lacks(feature)
	}
	return nil
}

// Collective is one process's handle on a group of processes (ranks) that
// run collective operations together over their backends' tensors: data
// parallel training (package train/dist) all-reduces gradients through it,
// and the ZeRO stages reduce-scatter and all-gather. A device backend
// implements it with its vendor's library (the CUDA backend with NCCL);
// every rank of the group calls the same operations in the same order
// with the same sizes. Operations are enqueued in issue order with the
// backend's kernels (no host synchronization) and are F32 only, except
// AllGather (below).
type Collective interface {
	// Rank is this process's index in [0, Size()).
	Rank() int
	// Size is the number of ranks.
	Size() int
	// AllReduceSum: t[0:n) = the sum over the ranks of their t[0:n), in
	// place.
	AllReduceSum(t Tensor, n int)
	// ReduceScatterSum: dst[0:n) = the sum over the ranks of their
	// src[rank·n : (rank+1)·n); src holds Size()·n elements.
	ReduceScatterSum(dst, src Tensor, n int)
	// AllGather: dst[r·n : (r+1)·n) = rank r's src[0:n), for every r; dst
	// holds Size()·n elements. dst and src are F32, or both BF16 on a
	// backend with BF16 tensors (ZeRO stage 3 gathers the BF16 roundings
	// of the GEMM weights: half the bytes); every rank passes the same
	// dtype.
	AllGather(dst, src Tensor, n int)
	// Broadcast: t[0:n) = root's t[0:n) on every rank.
	Broadcast(t Tensor, n int, root int)
	// Close releases the group (after all issued work).
	Close() error
}

// BF16Rounder is implemented by backends whose GEMMs read their F32
// weights rounded to BF16 (the CUDA backend: every GEMM operand is BF16,
// a trained parameter's rounding made once per optimizer step, its
// shadow). RoundBF16 makes that rounding into a tensor of the caller's:
// a GEMM given dst reads the bits it reads given src, so a ZeRO stage 3
// rank all-gathers the BF16 roundings of its parts of the GEMM weights
// (half the bytes of the fp32 parts) and trains bit for bit as with the
// fp32 gather (package train's Sharding). A backend whose GEMMs read fp32
// (the CPU) does not implement it.
type BF16Rounder interface {
	// RoundBF16: dst[0:n) (BF16) = src[0:n) (F32) rounded to nearest
	// even, element by element.
	RoundBF16(dst, src Tensor, n int)
}

// ResidualMatMul is implemented by backends whose GEMMs can add a
// residual in their epilogue (the CUDA backend: cuBLASLt's C with beta
// 1), so that a decoder's residual connection after o_proj and down_proj
// costs no pass of its own.
type ResidualMatMul interface {
	// MatMulResidual: out (m,n) F32 = x (m,k) (act) · wᵀ (w (n,k)) + res
	// (m,n) F32: MatMul's fp32 product plus res, rounded once, as MatMul
	// into an F32 out followed by Add (up to the GEMM's order of
	// summation, which may differ from MatMul's). It returns false, and
	// does nothing, for a weight it cannot take so (FP8): the caller then
	// runs MatMul and Add.
	MatMulResidual(out, x, w, res Tensor, m, n, k int) bool
}

// Overlapper is implemented by backends that can run work beside their
// stream of kernels: the CUDA backend on a second stream of the same GPU.
// ZeRO's collectives overlap the compute with it (package train: a
// block's gradients are reduce-scattered while the previous block's
// backward runs, the next block's weights all-gathered while this one's
// forward runs).
type Overlapper interface {
	// Beside runs f now on the calling goroutine; the work f issues on
	// the backend (kernels, copies, the backend's collectives) goes to the
	// second stream, after everything issued so far on the first, and
	// runs beside whatever the first stream gets next. The returned
	// Fence's Wait makes the work issued on the first stream after it
	// wait for f's. Nothing else may issue work on the backend while f
	// runs, and f must not call Beside.
	Beside(f func()) Fence
}

// Fence is work that runs beside a backend's stream (Overlapper.Beside).
type Fence interface {
	// Wait makes the backend's work issued from now on wait for the
	// fenced work (on the device: the host does not wait).
	Wait()
}

// Beside runs f beside be's later work where be is an Overlapper, else in
// order with it (the returned Fence's Wait then does nothing). Every use
// of what f writes, and every write of what f reads, must come after the
// Fence's Wait.
func Beside(be Backend, f func()) Fence {
	if o, ok := be.(Overlapper); ok {
		return o.Beside(f)
	}
	f()
	return noFence{}
}

type noFence struct{}

func (noFence) Wait() {}

// CollectiveID is the opaque token that joins the ranks of one group: rank
// 0 makes it (Collectives.NewCollectiveID) and hands it to the others out
// of band (package train/dist's rendezvous).
type CollectiveID [128]byte

// Collectives is implemented by backends that can form a Collective.
type Collectives interface {
	// NewCollectiveID makes a new group's token (rank 0 calls it).
	NewCollectiveID() (CollectiveID, error)
	// JoinCollective joins group id as rank of size ranks; it returns when
	// every rank has joined (or with an error naming what failed).
	JoinCollective(id CollectiveID, rank, size int) (Collective, error)
}

// CrossCopier is implemented by backends that copy another backend's
// tensor into one of their own directly: the CUDA backend from another
// GPU (peer to peer where the driver allows it, else through pinned host
// memory) or from another stream of the same GPU. A pipelined teacher
// hands each micro-batch's residual stream from one stage's device to the
// next with it.
type CrossCopier interface {
	// CopyFrom copies src, a tensor of backend from, into dst[0:src.Len())
	// (the same dtype), after the work from had issued when after was
	// marked (nil: the work from has issued so far) and before the work
	// this backend issues next. Neither side's host waits for the other:
	// the order is kept on the devices, and from's work issued after the
	// call (a Free of src, a write to it) runs after the copy, so src may
	// be reused or freed when it returns. false: from is a backend it
	// cannot copy from (another kind), nothing was done.
	CopyFrom(dst Tensor, from Backend, src Tensor, after Mark) bool
}

// Mark is a point in the work a backend has issued (Marker): what a copy
// to another backend must wait for, without the host waiting.
type Mark interface {
	// Release gives the mark back to its backend; a released mark is not
	// used again (ReleaseMark: nil's is a no-op).
	Release()
}

// Marker is implemented by backends whose work runs asynchronously to the
// host (a GPU's stream): Mark marks the work issued so far (a CUDA event
// recorded on the stream). A pipeline's stage marks its hand-off as soon
// as it has issued it, so that the next stage's copy waits for that work
// only, not for what the stage issues after.
type Marker interface {
	Mark() Mark
}

// MarkOf marks the work be has issued so far (Marker), or is nil for a
// backend whose calls return with their work done.
func MarkOf(be Backend) Mark {
	if m, ok := be.(Marker); ok {
		return m.Mark()
	}
	return nil
}

// ReleaseMark releases m unless it is nil.
func ReleaseMark(m Mark) {
	if m != nil {
		m.Release()
	}
}

// CopyAcross copies src, a tensor of backend from, into dst, a tensor of
// backend to, bit for bit, after the work from has issued so far: it is
// CopyAcrossAfter with no mark.
func CopyAcross(to Backend, dst Tensor, from Backend, src Tensor) {
	CopyAcrossAfter(to, dst, from, src, nil)
}

// CopyAcrossAfter copies src, a tensor of backend from, into dst, a
// tensor of backend to, bit for bit, after the work of from that after
// marks (MarkOf; nil: all it has issued): through to's CrossCopier when
// it takes from, else through the host (F32 and BF16 tensors: a BF16
// value widened to fp32 and rounded back is itself).
func CopyAcrossAfter(to Backend, dst Tensor, from Backend, src Tensor, after Mark) {
	if cc, ok := to.(CrossCopier); ok && cc.CopyFrom(dst, from, src, after) {
		return
	}
	if src.DType() != dst.DType() || dst.Len() < src.Len() {
		panic(fmt.Sprintf("compute: CopyAcross of %d %v elements into %d %v", src.Len(), src.DType(), dst.Len(), dst.DType()))
	}
	if src.DType() == I32 {
		panic("compute: CopyAcross of an I32 tensor through the host")
	}
	h := make([]float32, src.Len())
	from.ReadF32(src, h)
	to.WriteF32(dst, h)
}

// DeviceNamer is implemented by backends that run on a device of their
// own, named in errors about it: "GPU 1 (NVIDIA H100 80GB HBM3)".
type DeviceNamer interface {
	DeviceName() string
}

// DeviceName names the device be runs on (DeviceNamer), or the backend.
func DeviceName(be Backend) string {
	if n, ok := be.(DeviceNamer); ok {
		return n.DeviceName()
	}
	return be.Name()
}
