package compute

// LoRA is a low-rank adapter on a frozen Linear, as PEFT defines it (Hu et
// al., 2021; peft.tuners.lora.Linear):
//
//	out = x·Wᵀ + bias + Scale·(x·Aᵀ)·Bᵀ        Scale = lora_alpha / r
//
// with A (Rank, In) and B (Out, Rank), PEFT's lora_A.weight and
// lora_B.weight, in fp32. It is not a kernel of the contract but a
// composition of its kernels (MatMul, Scale, Add, MatMulBackward), so
// every backend runs it unchanged; the conformance suite checks it
// against float64 formulas and finite differences (subtest LoRALinear).
// Dropout, which PEFT applies to x before A (lora_dropout, training
// only), is the caller's: in training it hands both methods the dropped-out
// x, Backward a scratch dx, and passes that through DropoutBackward into
// its dx (see the conformance suite's LoRALinear/Dropout).
type LoRA struct {
	A, B          Tensor // (Rank, In), (Out, Rank) F32
	DA, DB        Tensor // their gradients (F32, +=); nil when not training
	Rank, In, Out int
	Scale         float32
	// Dropout is lora_dropout's p (0: none) and Stream the adapter's
	// DropoutMask key: the caller's, read by neither method.
	Dropout float64
	Stream  uint64
}

// Forward adds the adapter's term to out (m, Out), which holds the base
// Linear's x·Wᵀ + bias: out (act) += Scale·(x·Aᵀ)·Bᵀ, x (m, In) (act).
// t (m, Rank) and u (m, Out) are F32 scratch. The scale is applied to the
// rank-sized t rather than to the (m, Out) product (the same value up to
// fp32 rounding; PEFT scales the product). A BF16 out is rounded twice,
// once by the base GEMM and once by the add, as PEFT's result + lora term
// is in a BF16 model.
func (l *LoRA) Forward(be Backend, out, x, t, u Tensor, m int) {
	be.MatMul(t, x, l.A, nil, m, l.Rank, l.In)  // t (m, r) = x·Aᵀ
	be.Scale(t, m*l.Rank, l.Scale)              // t *= alpha/r
	be.MatMul(u, t, l.B, nil, m, l.Out, l.Rank) // u (m, Out) = t·Bᵀ
	be.Add(out, u, m*l.Out)                     // out += u
}

// Backward accumulates the adapter's gradients from dout (m, Out), the
// gradient of Forward's out, with x (m, In) (act) the forward's input:
//
//	t   = Scale·x·Aᵀ                     (recomputed: m·Rank, cheaper than kept)
//	DB += doutᵀ·t                        (Out, Rank)
//	dt  = Scale·dout·B                   (m, Rank)
//	DA += dtᵀ·x                          (Rank, In)
//	dx += dt·A                           (m, In), when dx is not nil
//
// t and dt (m, Rank) are F32 scratch. The base Linear's own dx term is the
// caller's (MatMulBackward with its frozen W and a nil dw).
func (l *LoRA) Backward(be Backend, dx, dout, x, t, dt Tensor, m int) {
	be.MatMul(t, x, l.A, nil, m, l.Rank, l.In)
	be.Scale(t, m*l.Rank, l.Scale)
	be.Zero(dt)
	be.MatMulBackward(dt, l.DB, nil, dout, t, l.B, m, l.Out, l.Rank)
	be.Scale(dt, m*l.Rank, l.Scale)
	be.MatMulBackward(dx, l.DA, nil, dt, x, l.A, m, l.Rank, l.In)
}
