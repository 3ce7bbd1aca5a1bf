package cuda

import (
	"fmt"
	"math"

	"distill/compute"
)

// LoRA adapters on the experts' projections (MoEWeights.Adapters), as
// compute/cpu's moelora.go: each adapter over its expert's grouped rows,
// run by the grouped kernels of kernels/moelora.cu on the device's own
// grouping (the offsets and the order in device memory, whichever path
// grouped the base's rows): no expert's row count reaches the host, and
// each product is one launch for every expert of a projection (two a
// projection forward, five backward, besides the table's upload), however
// many experts there are. An expert's adapters come to the kernels in a
// table of per-expert entries (moeLoRA.table: the adapters' addresses, 0
// for an expert without one, whose rows are skipped; scale, rank and
// dropout key), so the experts may differ in rank and dropout.
//
// The math is fp32 throughout (CUDA cores, not the tensor cores: an
// adapter's term carries no rounding beyond its inputs'): the BF16 rows
// the base's GEMMs read too (the input x, as token rows read in place
// through the order where the base's grouped GEMMs read it so, else the
// grouped rows xg; act; the gradients dy, dgate and dup) widened as the
// kernels stage them, and the fp32 adapters. The dropout's masks are drawn per token
// (the grouped row's token, order[row]/K), as MoEWeights.Drop defines
// them, with the expert's adapter's key, where the kernels stage x (and
// in dx's epilogue): no masked copy of the input. The scratch is the
// rank-sized t and dt: rows x rank fp32 each.

// moeLoRA is what the adapters' passes share: the grouping on the device
// (the offsets, the order, the adapters' row tiles) and the dropout's key.
type moeLoRA struct {
	devScratch
	offsets, order, tiles uint64
	rows, E, K            int
	drop                  *compute.MoEDrop
}

// moeLoRATile is the adapters' row tile (moelora.cu's MLR_BM), their row
// kernels' column tiles (16: a rank; 64: a projection's width), and an
// expert's words in the table (MLR_WORDS).
const (
	moeLoRATile   = 64
	moeLoRANarrow = 16
	moeLoRAWide   = 64
	moeLoRAWords  = 8
)

// newMoELoRA prepares the adapters' passes over rows grouped rows on the
// device's grouping (offsets (E+1), order (rows) I32): their row tiles
// (k_moelora_tiles). drop: the adapters drop out (a training forward, and
// the backward) under mw.Drop.
func (b *Backend) newMoELoRA(mw *compute.MoEWeights, offsets, order uint64, rows, K int, drop bool) *moeLoRA {
	E := mw.NumExperts
	r := &moeLoRA{devScratch: devScratch{b: b}, offsets: offsets, order: order, rows: rows, E: E, K: K}
	if drop {
		r.drop = mw.Drop
	}
	r.tiles = r.scratch(int64(E+1) * 4)
	b.launchKernel(launch{kernel: "k_moelora_tiles", grid: [3]int{1, 1, 1}, block: 32}, dptr(offsets), int32(E), dptr(r.tiles))
	return r
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

func (r *moeLoRA) mask(l *compute.LoRA) *compute.DropoutMask {
	if r.drop == nil || l.Dropout == 0 {
		return nil
	}
	d := compute.NewDropoutMask(l.Stream, r.drop.Step, r.drop.Row, l.Dropout)
	return &d
}

// table uploads the experts' entries for the adapters ls (moelora.cu's
// mlr_ad: A, B, DA, DB, the scale and rank, the dropout's key, threshold
// and scale) and returns it with the largest rank, 0 when no expert has
// one, and the projection's input and output widths (moeAdapters checked
// them). grads: the adapters must have their gradients (a backward).
func (r *moeLoRA) table(ls func(e int) *compute.LoRA, what string, grads bool) (tab uint64, rank, in, out int) {
	h := make([]uint64, moeLoRAWords*r.E)
	for e := 0; e < r.E; e++ {
		l := ls(e)
		if l == nil {
			continue
		}
		w := fmt.Sprintf("%s expert %d adapter", what, e)
		a, bm, da, db := r.lora(l, w)
		if grads && da == 0 {
			panic(fmt.Sprintf("cuda: %s has no gradients (DA, DB)", w))
		}
		v := h[moeLoRAWords*e : moeLoRAWords*(e+1)]
		v[0], v[1], v[2], v[3] = a, bm, da, db
		v[4] = uint64(math.Float32bits(l.Scale)) | uint64(l.Rank)<<32
		if d := r.mask(l); d != nil {
			v[5] = uint64(d.Key[0]) | uint64(d.Key[1])<<32
			v[6] = uint64(d.Threshold) | uint64(math.Float32bits(d.Scale))<<32
			v[7] = 1
		}
		rank, in, out = max(rank, l.Rank), l.In, l.Out
	}
	if rank == 0 {
		return 0, 0, 0, 0
	}
	tab = r.scratch(int64(len(h)) * 8)
	r.b.upload(tab, unsafePtr(h), int64(len(h))*8)
	return tab, rank, in, out
}

// dropArgs are the kernels' last arguments: the grouped rows' order, the
// top-k, and the training row's place (MoEDrop's Row and Step).
func (r *moeLoRA) dropArgs() []any {
	var row, step int32
	if r.drop != nil {
		row, step = int32(r.drop.Row), int32(r.drop.Step)
	}
	return []any{dptr(r.order), int32(r.K), row, step}
}

// The row kernels' and the gradient kernels' operand roles.
const (
	mlrA, mlrB, mlrDA, mlrDB = 0, 1, 2, 3 // the table's words
	mlrRankK, mlrRankN       = 1, 2       // rk: K (M) or N is the expert's rank
	// An operand's format (moelora.cu's MLR_BF16, MLR_TOK): F32 or BF16,
	// grouped rows or the token rows read through the order.
	mlrF32, mlrBF16, mlrTok = 0, 1, 2
)

// rowsGEMM launches k_moelora_rows_<kernel> (moelora.cu's mlr_rows):
// out (rows, ldo) F32 (=, or += when acc) = s·a'·W_eᵀ (nt) or s·a'·W_e
// (nn) over each adapted expert's rows, W_e the table's word wi, tn its
// column tile.
func (r *moeLoRA) rowsGEMM(kernel string, tn int, out uint64, ldo int, a uint64, afmt int, lda int, tab uint64, wi, N, K, rk int,
	scaled, dropA, dropO, acc bool) {
	args := append([]any{dptr(out), int64(ldo), dptr(a), int32(afmt), int64(lda), dptr(tab), int32(wi), int32(N), int32(K), int32(rk),
		boolArg(scaled), boolArg(dropA), boolArg(dropO), boolArg(acc), dptr(r.offsets), dptr(r.tiles), int32(r.E)}, r.dropArgs()...)
	r.b.launchKernel(launch{kernel: "k_moelora_rows_" + kernel, grid: [3]int{(r.rows+moeLoRATile-1)/moeLoRATile + r.E, (N + tn - 1) / tn, 1}, block: 256}, args...)
}

// wgrad launches k_moelora_wgrad_<kernel> (mlr_wgrad): D_e (M, N) +=
// aᵀ·b' over each adapted expert's rows, D_e the table's word wi.
func (r *moeLoRA) wgrad(kernel string, tm, tn int, tab uint64, wi int, a uint64, afmt, lda, M int, bm uint64, bfmt, ldb, N, rk int, dropB bool) {
	args := append([]any{dptr(tab), int32(wi), dptr(a), int32(afmt), int64(lda), int32(M), dptr(bm), int32(bfmt), int64(ldb), int32(N),
		int32(rk), boolArg(dropB), dptr(r.offsets)}, r.dropArgs()...)
	r.b.launchKernel(launch{kernel: "k_moelora_wgrad_" + kernel, grid: [3]int{(M + tm - 1) / tm, (N + tn - 1) / tn, r.E}, block: 256}, args...)
}

// forward adds the adapters ls's terms to out (rows, out) F32 over each
// expert's rows, from x (rows, in) BF16, or with tok the token rows
// (tokens, in) BF16 that grouped row r reads through the order (row
// order[r]/K): out += Scale·(drop(x)·Aᵀ)·Bᵀ.
func (r *moeLoRA) forward(ls func(e int) *compute.LoRA, name string, out, x uint64, tok bool) {
	tab, R, in, outN := r.table(ls, "MoE "+name, false)
	if R == 0 {
		return
	}
	t := r.scratch(int64(r.rows) * int64(R) * 4)
	r.rowsGEMM("nt16", moeLoRANarrow, t, R, x, r.xfmt(tok), in, tab, mlrA, R, in, mlrRankN, true, true, false, false)
	r.rowsGEMM("nt64", moeLoRAWide, out, outN, t, mlrF32, R, tab, mlrB, outN, R, mlrRankK, false, false, false, true)
}

// backward is forward's backward from dout (rows, out) BF16, x and tok as
// forward's: t = Scale·drop(x)·Aᵀ recomputed, DB += doutᵀ·t, dt =
// Scale·dout·B, DA += dtᵀ·drop(x), dx (rows, in) F32 += drop'(dt·A).
func (r *moeLoRA) backward(ls func(e int) *compute.LoRA, name string, dx, dout, x uint64, tok bool) {
	tab, R, in, outN := r.table(ls, "MoEBackward "+name, true)
	if R == 0 {
		return
	}
	t, dt := r.scratch(int64(r.rows)*int64(R)*4), r.scratch(int64(r.rows)*int64(R)*4)
	r.rowsGEMM("nt16", moeLoRANarrow, t, R, x, r.xfmt(tok), in, tab, mlrA, R, in, mlrRankN, true, true, false, false)
	r.wgrad("64x16", moeLoRAWide, moeLoRANarrow, tab, mlrDB, dout, mlrBF16, outN, outN, t, mlrF32, R, R, mlrRankN, false)
	r.rowsGEMM("nn16", moeLoRANarrow, dt, R, dout, mlrBF16, outN, tab, mlrB, R, outN, mlrRankN, true, false, false, false)
	r.wgrad("16x64", moeLoRANarrow, moeLoRAWide, tab, mlrDA, dt, mlrF32, R, R, x, r.xfmt(tok), in, in, mlrRankK, true)
	r.rowsGEMM("nn64", moeLoRAWide, dx, in, dt, mlrF32, R, tab, mlrA, in, R, mlrRankK, false, false, true, true)
}

// xfmt is the format of the adapters' input x: BF16 grouped rows, or with
// tok the token rows read through the order.
func (r *moeLoRA) xfmt(tok bool) int {
	if tok {
		return mlrBF16 | mlrTok
	}
	return mlrBF16
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
