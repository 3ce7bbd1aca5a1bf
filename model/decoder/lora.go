package decoder

import (
	"fmt"

	"distill/compute"
)

// LoRA students: a frozen base with low-rank adapters on some of its
// Linears (Linear.LoRA, see compute.LoRA for the formula, PEFT's). The
// base's tensors are bound with nil gradients (New's Binder returns
// none): the backward then computes no weight gradient for them (a nil
// dw to MatMulBackward, no EmbedBackward) and sends the norms' weight
// gradients, which RMSNormBackward always makes, to a scratch that is
// never read. The activations' gradients flow through the base as
// before: the adapters of layer i need the gradients of every layer
// above it.
//
// Dropout (compute.LoRA.Dropout, PEFT's lora_dropout) applies to an
// adapter's input in training only: a TrainForward keyed by
// SetLoRADropout (a ForwardBackward's) drops, any other (an evaluation)
// does not. The dropped-out input is not kept for the backward: the
// backward draws it again from the layer's kept input (the mask is a
// pure function of its key, compute.DropoutMask), into one scratch all
// adapters share, as a recompute would.

// loraState is the scratch of the adapters: t and dt (N, max rank), u
// (N, max Out), F32, sized for the largest batch so far, and the discard
// of frozen norms' weight gradients.
type loraState struct {
	on          bool
	rank, out   int // the largest adapter rank and output width
	n           int // tokens the scratch is sized for
	t, dt, u    compute.Tensor
	discard     compute.Tensor // (max(hidden, head_dim)) F32
	discardSize int
	// dropIn is the largest input width of an adapter with dropout (0:
	// none); xd (N, dropIn) (act) holds an adapter's dropped-out input and
	// dxd (N, dropIn) F32 its gradient.
	dropIn  int
	xd, dxd compute.Tensor
	// next keys the next TrainForward's dropout (SetLoRADropout), cur
	// the last one's (nil: none, an evaluation).
	next, cur *dropKey
}

// dropKey is a training row's place: the optimizer step and the packed
// row's index in the step (compute.DropoutMask's Step and Row).
type dropKey struct{ step, row uint32 }

// AttachLoRA puts an adapter on every Linear of the blocks for which
// adapter returns one (nil: none). An MoE block's experts take theirs
// inside the MoE kernels (compute.MoEWeights.Adapters, each over its
// expert's grouped rows); a frozen MoE block's backward computes dx and
// the adapters' gradients alone (moeGrads).
func (m *Model) AttachLoRA(adapter func(l *Linear) *compute.LoRA) error {
	for i := range m.Blocks {
		L := &m.Blocks[i]
		for j, l := range L.Linears() {
			a := adapter(l)
			if a == nil {
				continue
			}
			if a.In != l.In || a.Out != l.Out || a.Rank <= 0 {
				return fmt.Errorf("%w: %s: adapter of rank %d, %d -> %d, on a Linear %d -> %d", ErrInvalid, l.Name, a.Rank, a.In, a.Out, l.In, l.Out)
			}
			if !(a.Dropout >= 0 && a.Dropout < 1) {
				return fmt.Errorf("%w: %s: adapter dropout %g: want 0 <= p < 1", ErrInvalid, l.Name, a.Dropout)
			}
			if L.MoE != nil && j >= 4 { // Linears: q, k, v, o, then the experts' gate, up, down
				if L.MoE.Adapters == nil {
					L.MoE.Adapters = make([]compute.MoEAdapter, len(L.Experts))
				}
				ad := &L.MoE.Adapters[(j-4)/3]
				switch (j - 4) % 3 {
				case 0:
					ad.Gate = a
				case 1:
					ad.Up = a
				default:
					ad.Down = a
				}
				l.LoRA = a
				m.lora.on = true
				continue
			}
			l.LoRA = a
			m.lora.on = true
			m.lora.rank, m.lora.out = max(m.lora.rank, a.Rank), max(m.lora.out, a.Out)
			if a.Dropout > 0 {
				m.lora.dropIn = max(m.lora.dropIn, a.In)
			}
		}
	}
	m.train.arenaN = -1 // an o_proj adapter keeps datt F32 (carveGrads)
	return nil
}

// LoRA reports whether adapters are attached.
func (m *Model) LoRA() bool { return m.lora.on }

// SetLoRADropout keys the adapters' dropout of the next TrainForward and
// of its Backward: step, the optimizer step, and row, the packed row's
// index in the step. A TrainForward not keyed so applies none.
func (m *Model) SetLoRADropout(step, row uint32) { m.lora.next = &dropKey{step, row} }

// moeDrop keys an MoE block's expert adapters' dropout for the current
// batch (MoEWeights.Drop: nil for none, an evaluation).
func (m *Model) moeDrop(b *Block) {
	if b.MoE.Adapters == nil {
		return
	}
	b.MoE.Drop = nil
	if k := m.lora.cur; k != nil {
		b.MoE.Drop = &compute.MoEDrop{Step: k.step, Row: k.row}
	}
}

// dropMask is l's dropout mask in the current batch, nil for none (no
// adapter dropout, or a batch not keyed by SetLoRADropout).
func (m *Model) dropMask(l *Linear) *compute.DropoutMask {
	k := m.lora.cur
	if l.LoRA == nil || l.LoRA.Dropout == 0 || k == nil {
		return nil
	}
	d := compute.NewDropoutMask(l.LoRA.Stream, k.step, k.row, l.LoRA.Dropout)
	return &d
}

// loraScratch sizes the adapters' scratch for N tokens.
func (m *Model) loraScratch(N int) {
	st := &m.lora
	if N <= st.n {
		return
	}
	for _, t := range []compute.Tensor{st.t, st.dt, st.u, st.xd, st.dxd} {
		if t != nil {
			m.be.Free(t)
		}
	}
	st.t, st.dt, st.u, st.xd, st.dxd = nil, nil, nil, nil, nil
	st.n = 0
	st.t, st.dt = m.be.New(compute.F32, N*st.rank), m.be.New(compute.F32, N*st.rank)
	st.u = m.be.New(compute.F32, N*st.out)
	if st.dropIn > 0 {
		st.xd, st.dxd = m.be.New(m.be.ActDType(), N*st.dropIn), m.be.New(compute.F32, N*st.dropIn)
	}
	st.n = N
}

// LoRAScratchBytes is what the adapters' scratch takes for N tokens with
// adapters of rank at most rank on Linears at most out wide, and, when
// dropIn > 0, the dropout's input and gradient scratch for inputs at most
// dropIn wide with activations of type act.
func LoRAScratchBytes(N, rank, out, dropIn int, act compute.DType) int64 {
	return 4*int64(N)*int64(2*rank+out) + int64(N)*int64(dropIn)*int64(act.Size()+4)
}

// linear is l's forward: out (N, Out) = x·Wᵀ + b, plus the adapter's term.
func (m *Model) linear(l *Linear, out, x compute.Tensor, N int) {
	m.be.MatMul(out, x, l.weight(), l.B, N, l.Out, l.In)
	if l.LoRA != nil {
		m.loraScratch(N)
		xa := x
		if d := m.dropMask(l); d != nil {
			xa = m.be.View(m.lora.xd, 0, N*l.In)
			m.be.Dropout(xa, x, d, N, l.In)
		}
		l.LoRA.Forward(m.be, out, xa, m.lora.t, m.lora.u, N)
	}
}

// linearBackward is l's backward from dout (N, Out), x the forward's
// input: dx (N, In) +=, and the gradients of W and b (none when frozen)
// and of the adapter.
func (m *Model) linearBackward(l *Linear, dx, dout, x compute.Tensor, N int) {
	m.be.MatMulBackward(dx, l.DW, l.DB, dout, x, l.weight(), N, l.Out, l.In)
	if l.LoRA == nil {
		return
	}
	m.loraScratch(N)
	d := m.dropMask(l)
	if d == nil {
		l.LoRA.Backward(m.be, dx, dout, x, m.lora.t, m.lora.dt, N)
		return
	}
	// The forward's dropped-out input, drawn again; the adapter's dx
	// w.r.t. it into a scratch, then through the dropout into dx.
	xa := m.be.View(m.lora.xd, 0, N*l.In)
	m.be.Dropout(xa, x, d, N, l.In)
	var dxa compute.Tensor
	if dx != nil {
		dxa = m.be.View(m.lora.dxd, 0, N*l.In)
		m.be.Zero(dxa)
	}
	l.LoRA.Backward(m.be, dxa, dout, xa, m.lora.t, m.lora.dt, N)
	if dx != nil {
		m.be.DropoutBackward(dx, dxa, d, N, l.In)
	}
}

// dw is a norm's weight gradient: g, or for a frozen norm (g nil) a
// scratch of n elements that is never read.
func (m *Model) dw(g compute.Tensor, n int) compute.Tensor {
	if g != nil {
		return g
	}
	st := &m.lora
	if st.discardSize < n {
		if st.discard != nil {
			m.be.Free(st.discard)
		}
		st.discard, st.discardSize = m.be.New(compute.F32, n), n
	}
	return st.discard
}

// freeLoRA releases the adapters' scratch (the adapters are the caller's).
func (m *Model) freeLoRA() {
	st := &m.lora
	for _, t := range []compute.Tensor{st.t, st.dt, st.u, st.discard, st.xd, st.dxd} {
		if t != nil {
			m.be.Free(t)
		}
	}
	st.t, st.dt, st.u, st.discard, st.xd, st.dxd = nil, nil, nil, nil, nil, nil
	st.n, st.discardSize = 0, 0
}
