package cuda

import (
	"fmt"

	"distill/compute"
)

// LoRA adapters on the experts' projections (MoEWeights.Adapters), as
// compute/cpu's moelora.go: each adapter over its expert's grouped rows,
// with the host's copy of the grouping's offsets (one E+1 download a
// call: the rank-r GEMMs are cuBLASLt's, one per expert, sized on the
// host; k_moe_gemm's tiles are 128 wide and need inner dimensions of
// multiples of 8, which a rank need not be). The adapters' GEMMs run in
// fp32 (dataF32): their operands are the grouped BF16 rows widened (the
// inputs xg and act, the gradients dy, dgate and dup, which the base's
// GEMMs read in BF16 too) and the fp32 adapters, so that an adapter's
// term carries no rounding beyond its inputs'. The dropout's masks are
// drawn per token (k_dropout with the order: the grouped row's token,
// order[row]/K), as MoEWeights.Drop defines them. Their scratch is one
// expert's at a time: rows x (2·In + Out + 2·rank) fp32 at most.

// moeLoRA is what the adapters' passes share: the offsets on the host,
// the grouping on the device and the dropout's key.
type moeLoRA struct {
	b     *Backend
	off   []int32
	order uint64
	K     int
	drop  *compute.MoEDrop
	tmp   []uint64
}

func (b *Backend) newMoELoRA(mw *compute.MoEWeights, offsets, order uint64, K int, drop bool) *moeLoRA {
	E := mw.NumExperts
	r := &moeLoRA{b: b, off: make([]int32, E+1), order: order, K: K}
	if drop {
		r.drop = mw.Drop
	}
	b.download(unsafePtr(r.off), offsets, int64(E+1)*4)
	return r
}

func (r *moeLoRA) scratch(n int64) uint64 {
	p := r.b.alloc(n)
	r.tmp = append(r.tmp, p)
	return p
}

func (r *moeLoRA) release() {
	for _, p := range r.tmp {
		r.b.free(p)
	}
	r.tmp = nil
}

// lora returns l's tensors' addresses, checked.
func (r *moeLoRA) lora(l *compute.LoRA, what string) (a, bm, da, db uint64) {
	b := r.b
	at, bt := b.ten(l.A, what+" A"), b.ten(l.B, what+" B")
	need(at, what+" A", l.Rank*l.In, compute.F32)
	need(bt, what+" B", l.Out*l.Rank, compute.F32)
	if l.DA != nil {
		dat, dbt := b.ten(l.DA, what+" DA"), b.ten(l.DB, what+" DB")
		need(dat, what+" DA", l.Rank*l.In, compute.F32)
		need(dbt, what+" DB", l.Out*l.Rank, compute.F32)
		da, db = dat.p, dbt.p
	}
	return at.p, bt.p, da, db
}

// input returns expert rows [o, o+n) of x (rows, cols) BF16 as l's input
// in F32: dropped out under l's mask, else widened.
func (r *moeLoRA) input(l *compute.LoRA, x uint64, o, n, cols int) uint64 {
	b := r.b
	out := r.scratch(int64(n) * int64(cols) * 4)
	src := x + uint64(o)*uint64(cols)*2
	if d := r.mask(l); d != nil {
		k0, k1, row, step, thr := dropoutArgs(d)
		b.ew("k_dropout", int64(n)*int64((cols+3)/4), dptr(out), int32(0), dptr(src), int32(1), dptr(r.order+uint64(o)*4), int32(r.K), int64(n), int32(cols),
			k0, k1, row, step, thr, d.Scale)
		return out
	}
	b.convert("k_bf16_to_f32", out, src, int64(n)*int64(cols))
	return out
}

func (r *moeLoRA) mask(l *compute.LoRA) *compute.DropoutMask {
	if r.drop == nil || l.Dropout == 0 {
		return nil
	}
	d := compute.NewDropoutMask(l.Stream, r.drop.Step, r.drop.Row, l.Dropout)
	return &d
}

// forward adds adapter l's term to out (rows, Out) F32 over each expert
// e's rows, from x (rows, In) BF16: out += Scale·(drop(x)·Aᵀ)·Bᵀ.
func (r *moeLoRA) forward(ls func(e int) *compute.LoRA, name string, out, x uint64) {
	b := r.b
	for e := 0; e+1 < len(r.off); e++ {
		l := ls(e)
		o, n := int(r.off[e]), int(r.off[e+1]-r.off[e])
		if l == nil || n == 0 {
			continue
		}
		a, bm, _, _ := r.lora(l, fmt.Sprintf("MoE expert %d %s adapter", e, name))
		r.release() // the previous expert's scratch (stream-ordered)
		xa := r.input(l, x, o, n, l.In)
		t := r.scratch(int64(n) * int64(l.Rank) * 4)
		b.gemmEx(t, xa, a, n, l.Rank, l.In, false, true, dataF32, 0)
		b.ew("k_scale", int64(n)*int64(l.Rank), dptr(t), int64(n)*int64(l.Rank), l.Scale)
		b.gemmEx(out+uint64(o)*uint64(l.Out)*4, t, bm, n, l.Out, l.Rank, false, true, dataF32, 1)
	}
}

// backward is forward's backward from dout (rows, Out) BF16, x as
// forward's: DB += doutᵀ·t, dt = Scale·dout·B, DA += dtᵀ·drop(x), dx
// (rows, In) F32 += drop'(dt·A), with t = Scale·drop(x)·Aᵀ recomputed.
func (r *moeLoRA) backward(ls func(e int) *compute.LoRA, name string, dx, dout, x uint64) {
	b := r.b
	for e := 0; e+1 < len(r.off); e++ {
		l := ls(e)
		o, n := int(r.off[e]), int(r.off[e+1]-r.off[e])
		if l == nil || n == 0 {
			continue
		}
		what := fmt.Sprintf("MoEBackward expert %d %s adapter", e, name)
		a, bm, da, db := r.lora(l, what)
		if da == 0 {
			panic(fmt.Sprintf("cuda: %s has no gradients (DA, DB)", what))
		}
		r.release() // the previous expert's scratch (stream-ordered)
		xa := r.input(l, x, o, n, l.In)
		d32 := r.scratch(int64(n) * int64(l.Out) * 4)
		b.convert("k_bf16_to_f32", d32, dout+uint64(o)*uint64(l.Out)*2, int64(n)*int64(l.Out))
		t, dt := r.scratch(int64(n)*int64(l.Rank)*4), r.scratch(int64(n)*int64(l.Rank)*4)
		nr := int64(n) * int64(l.Rank)
		b.gemmEx(t, xa, a, n, l.Rank, l.In, false, true, dataF32, 0)
		b.ew("k_scale", nr, dptr(t), nr, l.Scale)
		b.gemmEx(db, d32, t, l.Out, l.Rank, n, true, false, dataF32, 1)
		b.gemmEx(dt, d32, bm, n, l.Rank, l.Out, false, false, dataF32, 0)
		b.ew("k_scale", nr, dptr(dt), nr, l.Scale)
		b.gemmEx(da, dt, xa, l.Rank, l.In, n, true, false, dataF32, 1)
		dxe := dx + uint64(o)*uint64(l.In)*4
		d := r.mask(l)
		if d == nil {
			b.gemmEx(dxe, dt, a, n, l.In, l.Rank, false, false, dataF32, 1)
			continue
		}
		dxa := r.scratch(int64(n) * int64(l.In) * 4)
		b.gemmEx(dxa, dt, a, n, l.In, l.Rank, false, false, dataF32, 0)
		k0, k1, row, step, thr := dropoutArgs(d)
		b.ew("k_dropout_bwd", int64(n)*int64((l.In+3)/4), dptr(dxe), dptr(dxa), dptr(r.order+uint64(o)*4), int32(r.K), int64(n), int32(l.In),
			k0, k1, row, step, thr, d.Scale)
	}
}

// moeAdapters checks mw's adapters (one per expert, shapes of the
// projections, no FP8 experts or QAD) and returns the accessors of the
// three projections', nil when mw has none.
func moeAdapters(mw *compute.MoEWeights, fp8 bool, what string) (gate, up, down func(e int) *compute.LoRA) {
	if mw.Adapters == nil {
		return nil, nil, nil
	}
	switch {
	case len(mw.Adapters) != mw.NumExperts:
		panic(fmt.Sprintf("cuda: %s with %d experts has %d adapters: want one MoEAdapter per expert", what, mw.NumExperts, len(mw.Adapters)))
	case fp8 || mw.InAmax > 0 || mw.HAmax > 0:
		panic(fmt.Sprintf("cuda: %s: adapters (LoRA) with FP8 experts or QAD's quantized inputs: a LoRA student's base is neither", what))
	}
	for e, a := range mw.Adapters {
		for _, l := range []struct {
			l       *compute.LoRA
			in, out int
		}{{a.Gate, mw.Hidden, mw.Inter}, {a.Up, mw.Hidden, mw.Inter}, {a.Down, mw.Inter, mw.Hidden}} {
			if l.l != nil && (l.l.In != l.in || l.l.Out != l.out || l.l.Rank < 1) {
				panic(fmt.Sprintf("cuda: %s: expert %d's adapter of rank %d, %d -> %d, on a projection %d -> %d", what, e, l.l.Rank, l.l.In, l.l.Out, l.in, l.out))
			}
		}
	}
	return func(e int) *compute.LoRA { return mw.Adapters[e].Gate },
		func(e int) *compute.LoRA { return mw.Adapters[e].Up },
		func(e int) *compute.LoRA { return mw.Adapters[e].Down }
}

// anyAdapter reports whether some expert has an adapter of ls.
func anyAdapter(mw *compute.MoEWeights, ls func(e int) *compute.LoRA) bool {
	if ls == nil {
		return false
	}
	for e := range mw.Adapters {
		if ls(e) != nil {
			return true
		}
	}
	return false
}
