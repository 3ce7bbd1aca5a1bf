// Package compute holds the backend contract that the models run on, and the
// dtype helpers shared by every backend.
//
// # The contract
//
// A Backend owns memory (Tensor handles) and runs the few kernels that the
// teacher forward needs: a GEMM against a weight matrix, embedding gather,
// RMSNorm, RoPE, packed causal attention, SwiGLU, residual add, the Qwen3-MoE
// expert FFN and the streaming LM-head top-k. Nothing else: architectures
// are assembled from these in package infer, which never learns which
// backend runs.
//
// The contract is written so that a device backend (CUDA) can keep every
// tensor resident on the device and enqueue kernels without synchronizing
// with the host:
//
//   - Kernels take Tensors and integer shapes, never host slices of data.
//     Per-batch integer metadata (token ids, positions, sample offsets) is
//     uploaded once as I32 tensors.
//   - Kernels may run asynchronously in issue order. Only the Read* methods
//     synchronize: they return after every kernel issued before them has
//     finished. The teacher reads once per batch (the top-k).
//   - Outputs never alias inputs unless a method says so (RoPE and Add work
//     in place by design).
//   - A Tensor belongs to the backend that made it; passing it to another
//     backend panics.
//
// Shapes are row-major and given in comments as (rows, cols). Every kernel
// overwrites its output (=), none accumulates (+=) unless it says so.
//
// The CPU backend (package compute/cpu) is the reference: every other backend
// is tested against it on the same inputs with |got-want| <= atol+rtol*|want|.
package compute

import "fmt"

// DType is the element type of a Tensor.
type DType uint8

// Element types.
const (
	F32  DType = iota // float32
	BF16              // bfloat16, stored as uint16
	I32               // int32
)

func (d DType) String() string {
	switch d {
	case F32:
		return "f32"
	case BF16:
		return "bf16"
	case I32:
		return "i32"
	}
	return fmt.Sprintf("dtype(%d)", uint8(d))
}

// Tensor is a handle to a flat buffer owned by one Backend.
type Tensor interface {
	DType() DType
	Len() int // elements
}

// Backend is the set of kernels the models call. See the package doc for the
// synchronization and aliasing contract.
type Backend interface {
	// Name is "cpu" or "cuda".
	Name() string

	// New returns a zeroed tensor of n elements.
	New(dt DType, n int) Tensor
	// FromF32 uploads host data as an F32 tensor.
	FromF32(src []float32) Tensor
	// FromI32 uploads host data as an I32 tensor.
	FromI32(src []int32) Tensor
	// Weight uploads a weight matrix given in BF16 or F32 host form; the
	// backend picks its storage (the CPU backend widens BF16 to F32, a GPU
	// backend keeps BF16 for its GEMMs). src is []uint16 (BF16) or []float32.
	Weight(src any) (Tensor, error)
	// ReadF32 and ReadI32 copy a tensor to the host, after all issued work.
	ReadF32(t Tensor, dst []float32)
	ReadI32(t Tensor, dst []int32)
	// Free releases a tensor; using it afterwards is an error.
	Free(t Tensor)

	// MatMul: x (m,k), w (n,k), bias (n) or nil -> out (m,n) = x·wᵀ + bias.
	// This is the layout of torch.nn.Linear weights.
	MatMul(out, x, w, bias Tensor, m, n, k int)
	// Embed: table (vocab,dim), ids (n) I32 -> out (n,dim).
	Embed(out, table, ids Tensor, n, dim int)
	// RMSNorm: x (rows,dim), w (dim) -> out (rows,dim), in fp32:
	// out = x / sqrt(mean(x²)+eps) * w. out may alias x.
	RMSNorm(out, x, w Tensor, rows, dim int, eps float32)
	// RoPE rotates x (tokens, heads, headDim) in place, rotate-half
	// convention, angle = pos[t] * invFreq[i] for i < headDim/2.
	// pos (tokens) I32, invFreq (headDim/2) F32.
	RoPE(x, pos, invFreq Tensor, tokens, heads, headDim int)
	// Attention: packed variable-length causal attention with GQA.
	// q (tokens, nHead, hd), k and v (tokens, nKV, hd); the samples are the
	// token ranges [starts[i], starts[i+1]) of starts (nSeq+1) I32; a token
	// attends to itself and earlier tokens of its own sample only.
	// out (tokens, nHead, hd). maxLen is the longest sample.
	Attention(out, q, k, v, starts Tensor, nSeq, maxLen, tokens, nHead, nKV, hd int, scale float32)
	// SwiGLU: out (n) = silu(gate)·up. out may alias gate.
	SwiGLU(out, gate, up Tensor, n int)
	// Add: a (n) += b (n).
	Add(a, b Tensor, n int)
	// MoE runs a Qwen3-MoE sparse FFN: router logits = x·routerᵀ, softmax
	// over experts in fp32, top-k experts per token (renormalized when
	// m.NormTopK), each expert a SwiGLU MLP, outputs summed with the
	// routing weights. x (tokens, hidden) -> out (tokens, hidden).
	MoE(out, x Tensor, m *MoEWeights, tokens int)
	// LMHeadTopK: x (tokens, hidden), w (vocab, hidden). For each token it
	// computes the logits over the whole vocabulary in tiles, keeping a
	// running top-k and log-sum-exp, and writes ids (tokens,k) I32 sorted
	// by descending logit (ties: lower id first) and logprobs (tokens,k) F32
	// = logit - logsumexp(all logits). [tokens x vocab] is never held.
	LMHeadTopK(ids, logprobs, x, w Tensor, tokens, hidden, vocab, k int)
}

// MoEWeights are the tensors of one Qwen3-MoE sparse block.
type MoEWeights struct {
	Router           Tensor   // (numExperts, hidden)
	Gate, Up, Down   []Tensor // per expert: (inter,hidden), (inter,hidden), (hidden,inter)
	NumExperts, TopK int
	Hidden, Inter    int
	NormTopK         bool
}
