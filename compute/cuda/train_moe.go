package cuda

import (
	"fmt"
	"strings"

	"distill/compute"
)

// The Qwen3-MoE block, forward (MoE, MoEForward) and backward
// (MoEBackward), mirroring compute/cpu's moe.go: the router in fp32, the
// (token, slot) pairs grouped by expert in token order, each expert's
// SwiGLU MLP as cuBLASLt GEMMs over its contiguous rows (BF16 operands,
// fp32 accumulation), and the kernels of kernels/moe.cu around them. The
// host reads the E per-expert row counts once per call (forward: from the
// routing; backward: the saved offsets) to size the GEMMs; experts with
// no rows are skipped.
//
// Determinism: the grouping is a function of the routing alone
// (k_moe_order, no atomics), every sum over the pairs of a token or the
// columns of a row has a fixed order, and cuBLASLt's GEMMs are
// deterministic for the algorithm a plan fixes. So a resumed run repeats
// the uninterrupted one bit for bit, MoE students included.

// moeCheck validates a MoE block's shape and returns E, K, H, I.
func moeCheck(mw *compute.MoEWeights, what string) (E, K, H, I int) {
	E, K, H, I = mw.NumExperts, mw.TopK, mw.Hidden, mw.Inter
	switch {
	case E < 1 || E > 512:
		panic(fmt.Sprintf("cuda: %s with %d experts: the routing kernel handles 1..512", what, E))
	case K < 1 || K > min(E, 32):
		panic(fmt.Sprintf("cuda: %s top-%d of %d experts: want 1..min(experts, 32)", what, K, E))
	case len(mw.Gate) != E || len(mw.Up) != E || len(mw.Down) != E:
		panic(fmt.Sprintf("cuda: %s with %d experts has %d/%d/%d gate/up/down weights", what, E, len(mw.Gate), len(mw.Up), len(mw.Down)))
	case H < 1 || I < 1:
		panic(fmt.Sprintf("cuda: %s with hidden %d, intermediate %d: want both >= 1", what, H, I))
	}
	return E, K, H, I
}

// moeSaved is MoESaved's tensors unwrapped and checked against the shapes.
type moeSaved struct {
	probs, sel, wts, order, offsets, gate, up, y *tensor
}

func (b *Backend) moeSaved(s *compute.MoESaved, what string, T, E, K, H, I int) *moeSaved {
	P := T * K
	v := &moeSaved{
		probs: b.ten(s.Probs, what+" saved Probs"), sel: b.ten(s.Sel, what+" saved Sel"), wts: b.ten(s.Wts, what+" saved Wts"),
		order: b.ten(s.Order, what+" saved Order"), offsets: b.ten(s.Offsets, what+" saved Offsets"),
		gate: b.ten(s.Gate, what+" saved Gate"), up: b.ten(s.Up, what+" saved Up"), y: b.ten(s.Y, what+" saved Y"),
	}
	need(v.probs, what+" saved Probs", T*E, compute.F32)
	need(v.sel, what+" saved Sel", P, compute.I32)
	need(v.wts, what+" saved Wts", P, compute.F32)
	need(v.order, what+" saved Order", P, compute.I32)
	need(v.offsets, what+" saved Offsets", E+1, compute.I32)
	need(v.gate, what+" saved Gate", P*I, compute.F32)
	need(v.up, what+" saved Up", P*I, compute.F32)
	need(v.y, what+" saved Y", P*H, compute.F32)
	return v
}

// moeOperands hands out BF16 copies of the experts' weights (a weight's
// copy is kept by the backend; other F32 tensors get scratch copies that
// release frees).
type moeOperands struct {
	devScratch
	what string
}

func (o *moeOperands) bf16(t compute.Tensor, name string, e, n int) uint64 {
	what := fmt.Sprintf("%s expert %d %s", o.what, e, name)
	w := o.b.ten(t, what)
	need(w, what, n, compute.F32, compute.BF16)
	p, s := o.b.bf16Operand(w, n)
	if s != 0 {
		o.own(s)
	}
	return p
}

// ptrs returns a device array of the experts' BF16 weight addresses (ws,
// each n elements), for k_moe_gemm.
func (o *moeOperands) ptrs(ws []compute.Tensor, name string, n int) uint64 {
	h := make([]uint64, len(ws))
	for e, t := range ws {
		h[e] = o.bf16(t, name, e, n)
	}
	return o.array(h)
}

// array uploads addresses h into a device array freed with the operands.
func (o *moeOperands) array(h []uint64) uint64 {
	d := o.scratch(int64(len(h)) * 8)
	o.b.upload(d, unsafePtr(h), int64(len(h))*8)
	return d
}

// moeGroups is the device's grouping of the experts' rows: offsets (E+1)
// and each expert's first row tile (k_moe_scan), over rows grouped rows.
type moeGroups struct {
	offsets, tileStart uint64
	rows, E            int
}

// moeGroupedOK reports whether k_moe_gemm takes the experts' shapes: its
// 16-byte copies need the inner dimensions (hidden and intermediate) to be
// multiples of 8.
func moeGroupedOK(H, I int) bool { return !testMoEHostGrouping && H%8 == 0 && I%8 == 0 }

// realDriver reports whether the backend runs on a real CUDA driver, not
// the emulator (testAsRealDriver: a test's stand-in for one).
func (b *Backend) realDriver() bool { return b.checkParams == nil || testAsRealDriver }

// testAsRealDriver makes the emulator's backend refuse what a real
// driver's refuses (realDriver).
var testAsRealDriver bool

// testMoEHostGrouping makes every MoE take the host's grouping and
// per-expert cuBLASLt GEMMs (a test compares the two).
var testMoEHostGrouping bool

// moeGEMM enqueues out (rows, n) F32 = a · w_eᵀ for each expert's grouped
// rows, w a device array of the experts' (n, k) BF16 weights (k_moe_gemm):
// one launch per projection, sized by an upper bound of the row tiles, so
// the host never waits for the routing. a is the grouped rows (rows, k)
// BF16, or with tok set the token rows (tokens, k) BF16 that grouped row r
// reads through tok (row tok.order[r] / tok.k: no gathered copy).
func (b *Backend) moeGEMM(out, a uint64, tok moeTokens, w uint64, g moeGroups, n, k int) {
	kernel := "k_moe_gemm" + b.moeGEMMVariant()
	b.launchKernel(launch{kernel: kernel, grid: b.moeGrid(g, n, moeBN), block: 256, smem: moeGEMMSmem(kernel)},
		dptr(out), dptr(a), dptr(tok.order), int32(max(tok.k, 1)), dptr(w), dptr(0), dptr(g.offsets), dptr(g.tileStart), int32(g.E), int32(n), int32(k))
}

// moeGEMMGLU enqueues act (rows, n) BF16 = silu(a·gate_eᵀ)·(a·up_eᵀ) for
// each expert's grouped rows (k_moe_gemm_glu): gate and up in one launch
// with the SwiGLU in its epilogue, neither product stored (the bits of
// moeGEMM's two products and moeAct without quantization). a and tok as
// moeGEMM's.
func (b *Backend) moeGEMMGLU(act, a uint64, tok moeTokens, gate, up uint64, g moeGroups, n, k int) {
	b.launchKernel(launch{kernel: "k_moe_gemm_glu", grid: moeFlatGrid(g, n, moeBN/2), block: 256, smem: moeGEMMSmem("k_moe_gemm_glu")},
		dptr(act), dptr(a), dptr(tok.order), int32(max(tok.k, 1)), dptr(gate), dptr(up), dptr(g.offsets), dptr(g.tileStart), int32(g.E), int32(n), int32(k))
}

// moeGEMMNN enqueues out (rows, n) F32 = a (rows, k) BF16 · w_e for each
// expert's grouped rows, w a device array of the experts' (k, n) BF16
// weights (k_moe_gemm_nn), adding to out when acc.
func (b *Backend) moeGEMMNN(out, a, w uint64, g moeGroups, n, k int, acc bool) {
	kernel := "k_moe_gemm_nn"
	if acc {
		kernel += "_acc"
	}
	kernel += b.moeGEMMVariant()
	b.launchKernel(launch{kernel: kernel, grid: b.moeGrid(g, n, moeBN), block: 256, smem: moeGEMMSmem(kernel)},
		dptr(out), dptr(a), dptr(0), int32(1), dptr(w), dptr(0), dptr(g.offsets), dptr(g.tileStart), int32(g.E), int32(n), int32(k))
}

// moeTokens says where a grouped GEMM's rows come from: order == 0, the
// grouped rows themselves; else grouped row r is token order[r] / k.
type moeTokens struct {
	order uint64
	k     int
}

// rowTiles is the grouped GEMMs' grid over rows: an upper bound of the
// experts' row tiles (a tile past tile_start[E] leaves at once).
func (g moeGroups) rowTiles() int { return (g.rows+moeBM-1)/moeBM + g.E }

// moeFlatGrid is a grouped GEMM's grid over g's row tiles and the column
// tiles of n columns bn wide, flat with a row tile's column tiles next to
// each other (moe.cu's moe_block: each tile of A rows read from memory
// once, not once per column tile).
func moeFlatGrid(g moeGroups, n, bn int) [3]int {
	return [3]int{g.rowTiles() * ((n + bn - 1) / bn), 1, 1}
}

// moeGrid is moeFlatGrid for the default kernels; the _v1 kernels keep
// the 2-D grid (row tiles in x, column tiles in y), as they ran before.
func (b *Backend) moeGrid(g moeGroups, n, bn int) [3]int {
	if b.moeGEMMVariant() == "_v1" {
		return [3]int{g.rowTiles(), (n + bn - 1) / bn, 1}
	}
	return moeFlatGrid(g, n, bn)
}

// moeGEMMVariant is the kernel suffix of the grouped GEMMs the backend
// runs: "" (64-wide K steps in three buffers), or "_v1" (32-wide in two,
// the kernels before them) under Options.MoEGEMM "v1", for an A/B on a
// device; _v1 also gathers the tokens and leaves the SwiGLU unfused.
func (b *Backend) moeGEMMVariant() string {
	if b.moeKernels == "v1" {
		return "_v1"
	}
	return ""
}

// moeWGrad enqueues dw[e] (n, k) F32 += a_eᵀ · x_e over each expert's
// grouped rows (k_moe_wgrad_gemm), dw a device array of the experts'
// gradient addresses, a (rows, n) BF16 and x the grouped rows (rows, k)
// BF16, or with tok set the token rows (moeGEMM's tok).
func (b *Backend) moeWGrad(dw, a, x uint64, tok moeTokens, g moeGroups, n, k int) {
	kernel := "k_moe_wgrad_gemm" + b.moeGEMMVariant()
	b.launchKernel(launch{kernel: kernel, grid: [3]int{(n + moeBM - 1) / moeBM, (k + moeBN - 1) / moeBN, g.E}, block: 256, smem: moeWGradSmem(kernel)},
		dptr(dw), dptr(a), dptr(x), dptr(tok.order), int32(max(tok.k, 1)), dptr(g.offsets), int32(n), int32(k))
}

// The grouped GEMMs' tiles (moe.cu: MOE_BM, MOE_BN, MOE_BK, MOE_STAGES;
// the _v1 kernels' MOE_V1_BK and MOE_WG_BK in two buffers).
const (
	moeBM, moeBN        = 128, 128
	moeBK, moeStages    = 64, 3
	moeV1BK, moeWGradBK = 32, 32
)

// moeWGradSmem is k_moe_wgrad_gemm's shared memory: stages of two tiles of
// BK rows of MOE_BN+8.
func moeWGradSmem(kernel string) int {
	if strings.HasSuffix(kernel, "_v1") {
		return 2 * 2 * moeWGradBK * (moeBN + 8) * 2
	}
	return moeStages * 2 * moeBK * (moeBN + 8) * 2
}

// moeGEMMSmem is the shared memory of a k_moe_gemm* kernel (moe.cu's
// MOE_GEMM_SMEM): stages of an A tile (MOE_BM rows of BK+8) and a W tile
// (MOE_BN rows of BK+8, or for the _nn kernels BK rows of MOE_BN+8).
func moeGEMMSmem(kernel string) int {
	bk, stages := moeBK, moeStages
	if strings.HasSuffix(kernel, "_v1") {
		bk, stages = moeV1BK, 2
	}
	w := moeBN * (bk + 8)
	if strings.HasPrefix(kernel, "k_moe_gemm_nn") {
		w = bk * (moeBN + 8)
	}
	return stages * (moeBM*(bk+8) + w) * 2
}

// moeExpertInput writes the experts' grouped input xg (rows, H) BF16: the
// token row of each grouped row, NVFP4-fake-quantized first under QAD
// (per row with one per-tensor amax, so quantizing the T token rows once
// gives what quantizing each gathered row would).
func (b *Backend) moeExpertInput(xg uint64, x *tensor, order uint64, mw *compute.MoEWeights, T, K, H int) {
	P := T * K
	src, q := x.p, uint64(0)
	if mw.InAmax > 0 {
		q = b.alloc(int64(T) * int64(H) * 4)
		b.ew("k_fakequant_nvfp4", int64(T)*int64((H+15)/16), dptr(q), int32(0), dptr(x.p), int32(0), int64(T), int32(H), compute.NVFP4GlobalScale(mw.InAmax), dptr(0))
		src = q
	}
	b.ew("k_moe_gather", int64(P)*int64(H), dptr(xg), dptr(src), dptr(order), int64(P), int32(K), int32(H))
	b.free(q)
}

// moeTokenInput writes the experts' input as token rows xb (T, H) BF16:
// x rounded, NVFP4-fake-quantized first under QAD; the grouped GEMMs read
// grouped row r from row order[r] / K, the bits moeExpertInput's gathered
// row would hold.
func (b *Backend) moeTokenInput(xb uint64, x *tensor, mw *compute.MoEWeights, T, H int) {
	if mw.InAmax > 0 {
		b.ew("k_fakequant_nvfp4", int64(T)*int64((H+15)/16), dptr(xb), int32(1), dptr(x.p), int32(0), int64(T), int32(H), compute.NVFP4GlobalScale(mw.InAmax), dptr(0))
		return
	}
	b.convert("k_f32_to_bf16", xb, x.p, int64(T)*int64(H))
}

// moeAct writes the down projection's input act (rows, I) BF16 =
// silu(gate)·up, NVFP4-fake-quantized under QAD (mw.HAmax > 0) before the
// rounding. The backward calls it again for dDown: the same bits.
func (b *Backend) moeAct(act, gate, up uint64, mw *compute.MoEWeights, rows, I int) {
	n := int64(rows) * int64(I)
	if mw.HAmax <= 0 {
		b.ew("k_swiglu", n, dptr(act), int32(1), dptr(gate), int32(0), dptr(up), int32(0), n)
		return
	}
	h := b.alloc(n * 4)
	b.ew("k_swiglu", n, dptr(h), int32(0), dptr(gate), int32(0), dptr(up), int32(0), n)
	b.ew("k_fakequant_nvfp4", int64(rows)*int64((I+15)/16), dptr(act), int32(1), dptr(h), int32(0), int64(rows), int32(I), compute.NVFP4GlobalScale(mw.HAmax), dptr(0))
	b.free(h)
}

// moeForward is MoE (s == nil: the routing and the experts' projections in
// scratch) and MoEForward (s: saved for the backward). The router GEMM
// runs in fp32 (routing is a discrete choice: BF16 logits would flip
// near-ties against the CPU); the experts' GEMMs in BF16.
func (b *Backend) moeForward(outT, xT compute.Tensor, mw *compute.MoEWeights, s *compute.MoESaved, T int, what string) {
	E, K, H, I := moeCheck(mw, what)
	out, x := b.ten(outT, what+" out"), b.ten(xT, what+" x")
	need(out, what+" out", T*H, compute.F32)
	need(x, what+" x", T*H, compute.F32)
	var sv *moeSaved
	if s != nil {
		sv = b.moeSaved(s, what, T, E, K, H, I)
	}
	if T == 0 {
		if sv != nil {
			b.memset0(sv.offsets.p, int64(E+1)*4)
		}
		return
	}
	r := &moeRun{devScratch: devScratch{b: b}, mw: mw, what: what, x: x, sv: sv, T: T, E: E, K: K, H: H, I: I, P: T * K}
	defer r.release()
	if sv != nil {
		r.probs, r.sel, r.wts, r.order, r.offsets = sv.probs.p, sv.sel.p, sv.wts.p, sv.order.p, sv.offsets.p
		r.gate, r.up, r.y = sv.gate.p, sv.up.p, sv.y.p
	} else {
		P := int64(r.P)
		r.sel, r.wts, r.order, r.offsets = r.scratch(P*4), r.scratch(P*4), r.scratch(P*4), r.scratch(int64(E+1)*4)
		r.y = r.scratch(P * int64(H) * 4)
	}
	fp8 := b.moeFP8(mw, what)
	if fp8 && sv != nil {
		panic("cuda: MoEForward (training) with FP8 experts: FP8 weights are a teacher's, forward only (MoE)")
	}
	// The grouping on the device (k_moe_scan) where the grouped GEMMs take
	// the shapes (FP8 experts also need 16-code copies, WeightFP8's shapes,
	// and mma.sync for E4M3: b.mmaE4M3), else through the host (planMoE)
	// and a GEMM per expert.
	r.onDevice = moeGroupedOK(H, I) && (!fp8 || H%16 == 0 && I%16 == 0 && b.mmaE4M3())
	r.route()
	switch {
	case fp8 && r.onDevice:
		b.moeExpertsFP8Grouped(r.y, x, r.order, mw, r.groups(), T, K, H, I, what)
	case fp8:
		if b.realDriver() && !testMoEHostGrouping {
			panic(fmt.Sprintf("cuda: %s with FP8 experts on %s needs the grouped FP8 kernels: an sm_89 or newer GPU and NVRTC 12.4 or newer (this one is %d.%d). "+
				"The per-expert cuBLASLt path that would run instead disagreed with the CPU on an H200 (TestMoEFP8Grouped, 2026-11-27), so it is off on GPUs: "+
				"use NVRTC 12.4 or newer (DISTILL_LIBNVRTC), or load the teacher's weights in BF16", what, b.info.Name, b.nv.major, b.nv.minor))
		}
		r.gateUp()
		b.moeExpertsFP8(r.gate, r.up, r.y, x, r.order, mw, r.plan, T, K, H, I, what)
	default:
		r.experts()
	}
	vec4 := H%4 == 0 && aligned16(out.p) && aligned16(r.y)
	b.launchKernel(launch{kernel: "k_moe_combine", grid: [3]int{T, 1, 1}, block: 256},
		dptr(out.p), dptr(r.y), dptr(r.sel), dptr(r.wts), dptr(r.rowpos), int32(K), int32(H), boolArg(vec4))
}

// moeRun is one MoE call's state: where its routing, grouping and
// projections go (MoEForward's saved tensors, or scratch freed at the
// end), and the grouping's plan.
type moeRun struct {
	devScratch
	mw                *compute.MoEWeights
	what              string
	x                 *tensor
	sv                *moeSaved
	T, E, K, H, I, P  int
	probs, sel, wts   uint64
	order, offsets, y uint64
	gate, up          uint64 // (rows, I) F32: saved, or scratch when a path stores them (gateUp)
	rowpos, tileStart uint64
	plan              moePlan // the host's grouping (!onDevice)
	onDevice          bool
}

// gateUp makes gate and up scratch where they are not saved (the fused
// GEMM stores neither).
func (r *moeRun) gateUp() {
	if r.gate == 0 {
		r.gate, r.up = r.scratch(int64(r.P)*int64(r.I)*4), r.scratch(int64(r.P)*int64(r.I)*4)
	}
}

func (r *moeRun) groups() moeGroups {
	return moeGroups{offsets: r.offsets, tileStart: r.tileStart, rows: r.P, E: r.E}
}

// route runs the router (an fp32 GEMM: routing is a discrete choice, and
// BF16 logits would flip near-ties against the CPU) and the top-k
// (k_moe_route), groups the (token, slot) pairs by expert (on the device,
// or through the host's plan) and lists them in that order (k_moe_order).
func (r *moeRun) route() {
	b, T, E, K, H := r.b, r.T, r.E, r.K, r.H
	router := b.ten(r.mw.Router, r.what+" router")
	need(router, r.what+" router", E*H, compute.F32, compute.BF16)
	rp, rs := b.f32Operand(router)
	logits := b.alloc(int64(T) * int64(E) * 4)
	b.gemm(logits, r.x.p, rp, T, E, H, dataF32)
	b.free(rs)
	counts := r.scratch(int64(E) * 4)
	b.memset0(counts, int64(E)*4)
	b.launchKernel(launch{kernel: "k_moe_route", grid: [3]int{(T + 7) / 8, 1, 1}, block: 256},
		dptr(logits), int64(T), int32(E), int32(K), boolArg(r.mw.NormTopK), dptr(r.sel), dptr(r.wts), dptr(counts), dptr(r.probs))
	b.free(logits)
	if r.onDevice {
		r.tileStart = r.scratch(int64(E+1) * 4)
		b.launchKernel(launch{kernel: "k_moe_scan", grid: [3]int{1, 1, 1}, block: 32}, dptr(counts), int32(E), dptr(r.offsets), dptr(r.tileStart))
	} else {
		hc := make([]int32, E)
		b.download(unsafePtr(hc), counts, int64(E)*4)
		var err error
		r.plan, err = planMoE(hc, T, K)
		b.must(err)
		b.upload(r.offsets, unsafePtr(r.plan.offsets), int64(E+1)*4)
	}
	r.rowpos = r.scratch(int64(r.P) * 4)
	b.launchKernel(launch{kernel: "k_moe_order", grid: [3]int{E, 1, 1}, block: 256},
		dptr(r.sel), dptr(r.offsets), int64(r.P), dptr(r.order), dptr(r.rowpos))
}

// experts runs the BF16 experts over the grouped rows into y: their input,
// gate and up (with the adapters of a LoRA student's experts), the SwiGLU
// and down, on the device's grouping or the host's.
func (r *moeRun) experts() {
	b, mw, T, K, H, I, P := r.b, r.mw, r.T, r.K, r.H, r.I, r.P
	ops := &moeOperands{devScratch: devScratch{b: b}, what: r.what}
	defer ops.release()
	act := r.scratch(int64(P) * int64(I) * 2)
	// The experts' adapters (a LoRA student's), each over its expert's rows:
	// gate's and up's before the SwiGLU, down's after the down GEMM. tok:
	// in is the token rows, read through the order.
	ga, ua, da := moeAdapters(mw, false, r.what)
	adapters := func(ls func(int) *compute.LoRA, name string, out, in uint64, tok bool) {}
	if ga != nil {
		lr := b.newMoELoRA(mw, r.offsets, r.order, P, K, r.sv != nil) // MoE (inference) never drops
		defer lr.release()
		adapters = func(ls func(int) *compute.LoRA, name string, out, in uint64, tok bool) {
			lr.forward(ls, name, out, in, tok)
		}
	}
	// The experts' input: the grouped rows xg (rows, H) BF16, or, where the
	// grouped GEMMs read the tokens in place (the default kernels; the
	// adapters' kernels read them in place too), the token rows (T, H)
	// BF16: 1/K of the bytes.
	var xin uint64
	tok := moeTokens{}
	if r.onDevice && b.moeKernels != "v1" {
		xin = r.scratch(int64(T) * int64(H) * 2)
		b.moeTokenInput(xin, r.x, mw, T, H)
		tok = moeTokens{order: r.order, k: K}
	} else {
		xin = r.scratch(int64(P) * int64(H) * 2)
		b.moeExpertInput(xin, r.x, r.order, mw, T, K, H)
	}
	if !r.onDevice {
		r.gateUp()
		r.hostGEMMs(ops, mw.Gate, "gate", xin, r.gate, I, H)
		r.hostGEMMs(ops, mw.Up, "up", xin, r.up, I, H)
		adapters(ga, "gate_proj", r.gate, xin, false)
		adapters(ua, "up_proj", r.up, xin, false)
		b.moeAct(act, r.gate, r.up, mw, P, I)
		r.hostGEMMs(ops, mw.Down, "down", act, r.y, H, I)
		adapters(da, "down_proj", r.y, act, false)
		return
	}
	g := r.groups()
	// Gate and up fused with the SwiGLU where nothing else reads them:
	// not saved for a backward, no adapter adding to them, no NVFP4
	// quantization of the SwiGLU's output (moeAct's).
	if r.sv == nil && ga == nil && mw.HAmax <= 0 && b.moeKernels != "v1" {
		b.moeGEMMGLU(act, xin, tok, ops.ptrs(mw.Gate, "gate", I*H), ops.ptrs(mw.Up, "up", I*H), g, I, H)
	} else {
		r.gateUp()
		b.moeGEMM(r.gate, xin, tok, ops.ptrs(mw.Gate, "gate", I*H), g, I, H)
		b.moeGEMM(r.up, xin, tok, ops.ptrs(mw.Up, "up", I*H), g, I, H)
		adapters(ga, "gate_proj", r.gate, xin, tok.order != 0)
		adapters(ua, "up_proj", r.up, xin, tok.order != 0)
		b.moeAct(act, r.gate, r.up, mw, P, I)
	}
	b.moeGEMM(r.y, act, moeTokens{}, ops.ptrs(mw.Down, "down", H*I), g, H, I)
	adapters(da, "down_proj", r.y, act, false)
}

// hostGEMMs runs out_e (rows, n) F32 = in_e (rows, k) BF16 · w_eᵀ for each
// expert e with rows on the host's grouping, a cuBLASLt GEMM each (name:
// the projection's, for errors).
func (r *moeRun) hostGEMMs(ops *moeOperands, w []compute.Tensor, name string, in, out uint64, n, k int) {
	off := r.plan.offsets
	for e := 0; e+1 < len(off); e++ {
		o, cnt := uint64(off[e]), int(off[e+1]-off[e])
		if cnt > 0 {
			r.b.gemm(out+o*uint64(n)*4, in+o*uint64(k)*2, ops.bf16(w[e], name, e, n*k), cnt, n, k, dataBF16)
		}
	}
}

// MoEForward implements compute.Backend: MoE's output, and s filled as
// the contract says (Probs, Sel, Wts, the stable grouping Order and
// Offsets, Gate, Up and Y in grouped order). Under QAD (m.InAmax > 0,
// m.HAmax > 0) the experts' inputs are fake-quantized; the router reads x
// as it is.
func (b *Backend) MoEForward(outT, xT compute.Tensor, mw *compute.MoEWeights, s *compute.MoESaved, tokens int) {
	defer b.enter()()
	b.wroteT(outT)
	if s != nil {
		b.wroteT(s.Probs, s.Sel, s.Wts, s.Order, s.Offsets, s.Gate, s.Up, s.Y)
	}
	b.label = "MoEForward"
	if s == nil {
		panic("cuda: MoEForward with no MoESaved (NewMoESaved makes one; MoE is the forward that saves nothing)")
	}
	b.moeForward(outT, xT, mw, s, tokens, "MoEForward")
}

// MoEBackward implements compute.Backend, mirroring the forward in
// reverse (as compute/cpu): the routing weights' gradients a = dout·Y
// (k_moe_wgrad), the routing backward into the router logits dl
// (k_moe_route_bwd, dprob included) and from them dx += dl·Router and
// dRouter += dlᵀ·x (fp32 GEMMs: the router is fp32 in the forward); then
// the experts over their grouped rows: dY = w·dout (BF16, k_moe_dy),
// dDown += dYᵀ·act with act recomputed from the saved Gate and Up,
// dact = dY·Down, SwiGLU's backward (k_moe_swiglu_bwd), dGate and dUp +=
// dᵀ·xg with xg the (quantized) grouped input gathered again, dxg =
// dgate·Gate + dup·Up; last each token's K rows of dxg are added to dx in
// ascending expert order (k_moe_dx). Straight-through under QAD. dm nil
// (a frozen block, a LoRA student's base): dx only; the router's fp32
// GEMM, the k_moe_wgrad_gemm launches and the recomputed act they read
// are skipped.
func (b *Backend) MoEBackward(dxT compute.Tensor, dm *compute.MoEWeights, doutT, xT compute.Tensor, mw *compute.MoEWeights, s *compute.MoESaved, dprobT compute.Tensor, T int) {
	defer b.enter()()
	b.wroteT(dxT)
	if dm != nil {
		b.wroteT(dm.Router)
		b.wroteT(dm.Gate...)
		b.wroteT(dm.Up...)
		b.wroteT(dm.Down...)
	}
	for _, a := range mw.Adapters {
		for _, l := range []*compute.LoRA{a.Gate, a.Up, a.Down} {
			if l != nil {
				b.wroteT(l.DA, l.DB)
			}
		}
	}
	b.label = "MoEBackward"
	const what = "MoEBackward"
	E, K, H, I := moeCheck(mw, what)
	if dm != nil && (len(dm.Gate) != E || len(dm.Up) != E || len(dm.Down) != E) {
		panic(fmt.Sprintf("cuda: %s: the gradients dm must hold a router and %d gate/up/down tensors", what, E))
	}
	dx, dout, x := b.ten(dxT, what+" dx"), b.ten(doutT, what+" dout"), b.ten(xT, what+" x")
	need(dx, what+" dx", T*H, compute.F32)
	need(dout, what+" dout", T*H, compute.F32)
	need(x, what+" x", T*H, compute.F32)
	if s == nil {
		panic("cuda: MoEBackward with no MoESaved: pass what MoEForward filled")
	}
	sv := b.moeSaved(s, what, T, E, K, H, I)
	router := b.ten(mw.Router, what+" router")
	need(router, what+" router", E*H, compute.F32, compute.BF16)
	var drouter *tensor
	if dm != nil {
		drouter = b.ten(dm.Router, what+" dRouter")
		need(drouter, what+" dRouter", E*H, compute.F32)
	}
	var dprob dptr
	if dprobT != nil {
		dp := b.ten(dprobT, what+" dprob")
		need(dp, what+" dprob", E, compute.F32)
		dprob = dptr(dp.p)
	}
	grad := func(t compute.Tensor, name string, e, n int) uint64 {
		w := fmt.Sprintf("%s d%s[%d]", what, name, e)
		g := b.ten(t, w)
		need(g, w, n, compute.F32)
		return g.p
	}
	if T == 0 {
		return
	}
	P := T * K
	onDevice := moeGroupedOK(H, I)
	var off []int32
	if !onDevice {
		off = make([]int32, E+1)
		b.download(unsafePtr(off), sv.offsets.p, int64(E+1)*4)
		if off[0] != 0 || int(off[E]) != P {
			panic(fmt.Sprintf("cuda: %s: saved offsets run %d..%d, want 0..%d (tokens·top_k): is s what MoEForward filled for %d tokens?", what, off[0], off[E], P, T))
		}
	}
	tmp := devScratch{b: b}
	defer tmp.release()
	scratch := tmp.scratch

	// The router: dl (T,E) from a (T·K), then two fp32 GEMMs.
	a, dl := scratch(int64(P)*4), scratch(int64(T)*int64(E)*4)
	b.launchKernel(launch{kernel: "k_moe_wgrad", grid: [3]int{(P + 7) / 8, 1, 1}, block: 256},
		dptr(a), dptr(sv.y.p), dptr(dout.p), dptr(sv.order.p), int64(P), int32(K), int32(H))
	b.launchKernel(launch{kernel: "k_moe_route_bwd", grid: [3]int{(T + 7) / 8, 1, 1}, block: 256},
		dptr(dl), dptr(sv.probs.p), dptr(sv.sel.p), dptr(sv.wts.p), dptr(a), dprob, int64(T), int32(E), int32(K), boolArg(mw.NormTopK))
	rp, rs := b.f32Operand(router)
	b.gemmEx(dx.p, dl, rp, T, H, E, false, false, dataF32, 1)
	b.free(rs)
	if drouter != nil {
		b.gemmEx(drouter.p, dl, x.p, E, H, T, true, false, dataF32, 1)
	}

	// The experts, over the grouped rows.
	dy := scratch(int64(P) * int64(H) * 2)
	b.ew("k_moe_dy", int64(P)*int64(H), dptr(dy), dptr(dout.p), dptr(sv.wts.p), dptr(sv.order.p), int64(P), int32(K), int32(H))
	// The weight gradients' operands: the down projection's input act
	// (recomputed) and the grouped input xg (gathered again).
	// The adapters' too (a LoRA student's experts).
	ga, ua, da := moeAdapters(mw, false, what)
	var lr *moeLoRA
	if ga != nil {
		lr = b.newMoELoRA(mw, sv.offsets.p, sv.order.p, P, K, true)
		defer lr.release()
	}
	var act, xg uint64
	if dm != nil || anyAdapter(mw, da) {
		act = scratch(int64(P) * int64(I) * 2)
		b.moeAct(act, sv.gate.p, sv.up.p, mw, P, I)
	}
	// The experts' input for dGate and dUp and the gate and up adapters'
	// backward: the token rows, read through the order as the forward read
	// them (the default kernels), or the grouped rows gathered again.
	tok := moeTokens{}
	readX := dm != nil || anyAdapter(mw, ga) || anyAdapter(mw, ua)
	switch {
	case readX && (!onDevice || b.moeKernels == "v1"):
		xg = scratch(int64(P) * int64(H) * 2)
		b.moeExpertInput(xg, x, sv.order.p, mw, T, K, H)
	case readX:
		xg = scratch(int64(T) * int64(H) * 2)
		b.moeTokenInput(xg, x, mw, T, H)
		tok = moeTokens{order: sv.order.p, k: K}
	}
	dh := scratch(int64(P) * int64(I) * 4)
	ops := &moeOperands{devScratch: devScratch{b: b}, what: what}
	defer ops.release()
	dg, du := scratch(int64(P)*int64(I)*2), scratch(int64(P)*int64(I)*2)
	dxg := scratch(int64(P) * int64(H) * 4)
	// The adapters' backward: down's into dh before the SwiGLU's
	// backward, gate's and up's into dxg.
	downBwd := func() {}
	if lr != nil {
		downBwd = func() { lr.backward(da, "down_proj", dh, dy, act, false) }
	}
	if onDevice {
		b.moeExpertsBackwardDevice(dm, mw, ops, grad, dy, act, xg, tok, dh, dg, du, dxg, sv, P, E, H, I, downBwd)
	} else {
		b.moeExpertsBackwardHost(off, dm, mw, ops, grad, dy, act, xg, dh, dg, du, dxg, sv, H, I, downBwd)
	}
	if lr != nil {
		lr.backward(ga, "gate_proj", dxg, dg, xg, tok.order != 0)
		lr.backward(ua, "up_proj", dxg, du, xg, tok.order != 0)
	}
	rowpos := scratch(int64(P) * 4)
	b.ew("k_moe_rowpos", int64(P), dptr(rowpos), dptr(sv.order.p), int64(P))
	b.launchKernel(launch{kernel: "k_moe_dx", grid: [3]int{T, 1, 1}, block: 256},
		dptr(dx.p), dptr(dxg), dptr(sv.sel.p), dptr(rowpos), int32(K), int32(H))
}

// moeExpertsBackwardDevice is MoEBackward's experts on the grouping the
// forward saved (k_moe_gemm's shapes), its row tiles rebuilt on the
// device: one launch a projection for every expert; dm nil: no weight
// gradients. afterDh runs once dh is complete, before the SwiGLU's
// backward reads it (the down adapters' dx).
func (b *Backend) moeExpertsBackwardDevice(dm, mw *compute.MoEWeights, ops *moeOperands, grad func(compute.Tensor, string, int, int) uint64,
	dy, act, xg uint64, tok moeTokens, dh, dg, du, dxg uint64, sv *moeSaved, P, E, H, I int, afterDh func()) {
	tileStart := b.alloc(int64(E+1) * 4)
	defer b.free(tileStart)
	b.launchKernel(launch{kernel: "k_moe_tiles", grid: [3]int{1, 1, 1}, block: 32}, dptr(sv.offsets.p), int32(E), dptr(tileStart))
	g := moeGroups{offsets: sv.offsets.p, tileStart: tileStart, rows: P, E: E}
	grads := func(ws []compute.Tensor, name string, n int) uint64 {
		h := make([]uint64, E)
		for e := range h {
			h[e] = grad(ws[e], name, e, n)
		}
		return ops.array(h)
	}
	if dm != nil {
		b.moeWGrad(grads(dm.Down, "Down", H*I), dy, act, moeTokens{}, g, H, I)
	}
	b.moeGEMMNN(dh, dy, ops.ptrs(mw.Down, "down", H*I), g, I, H, false)
	afterDh()
	b.ew("k_moe_swiglu_bwd", int64(P)*int64(I), dptr(dg), dptr(du), dptr(dh), dptr(sv.gate.p), dptr(sv.up.p), int64(P)*int64(I))
	if dm != nil {
		b.moeWGrad(grads(dm.Gate, "Gate", I*H), dg, xg, tok, g, I, H)
		b.moeWGrad(grads(dm.Up, "Up", I*H), du, xg, tok, g, I, H)
	}
	b.moeGEMMNN(dxg, dg, ops.ptrs(mw.Gate, "gate", I*H), g, H, I, false)
	b.moeGEMMNN(dxg, du, ops.ptrs(mw.Up, "up", I*H), g, H, I, true)
}

// moeExpertsBackwardHost is MoEBackward's experts on the host's grouping
// (off, read from the saved offsets): cuBLASLt GEMMs per expert with rows,
// for the shapes k_moe_gemm cannot take; dm nil: no weight gradients
// (act and xg unset). afterDh runs once dh is complete, before the
// SwiGLU's backward reads it (the down adapters' dx).
func (b *Backend) moeExpertsBackwardHost(off []int32, dm, mw *compute.MoEWeights, ops *moeOperands, grad func(compute.Tensor, string, int, int) uint64,
	dy, act, xg, dh, dg, du, dxg uint64, sv *moeSaved, H, I int, afterDh func()) {
	E := len(off) - 1
	P := int(off[E])
	for e := 0; e < E; e++ {
		o, cnt := uint64(off[e]), int(off[e+1]-off[e])
		if cnt == 0 {
			continue
		}
		dye := dy + o*uint64(H)*2
		if dm != nil {
			b.gemmEx(grad(dm.Down[e], "Down", e, H*I), dye, act+o*uint64(I)*2, H, I, cnt, true, false, dataBF16, 1)
		}
		b.gemmEx(dh+o*uint64(I)*4, dye, ops.bf16(mw.Down[e], "down", e, H*I), cnt, I, H, false, false, dataBF16, 0)
	}
	afterDh()
	b.ew("k_moe_swiglu_bwd", int64(P)*int64(I), dptr(dg), dptr(du), dptr(dh), dptr(sv.gate.p), dptr(sv.up.p), int64(P)*int64(I))
	for e := 0; e < E; e++ {
		o, cnt := uint64(off[e]), int(off[e+1]-off[e])
		if cnt == 0 {
			continue
		}
		dge, due, xe := dg+o*uint64(I)*2, du+o*uint64(I)*2, xg+o*uint64(H)*2
		if dm != nil {
			b.gemmEx(grad(dm.Gate[e], "Gate", e, I*H), dge, xe, I, H, cnt, true, false, dataBF16, 1)
			b.gemmEx(grad(dm.Up[e], "Up", e, I*H), due, xe, I, H, cnt, true, false, dataBF16, 1)
		}
		dxe := dxg + o*uint64(H)*4
		b.gemmEx(dxe, dge, ops.bf16(mw.Gate[e], "gate", e, I*H), cnt, H, I, false, false, dataBF16, 0)
		b.gemmEx(dxe, due, ops.bf16(mw.Up[e], "up", e, I*H), cnt, H, I, false, false, dataBF16, 1)
	}
}
