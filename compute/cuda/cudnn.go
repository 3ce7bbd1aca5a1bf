package cuda

/*
#cgo LDFLAGS: -ldl
#include <stdlib.h>
#include "capi.h"
#include "cudnn_sdpa.h"
*/
import "C"

import (
	"fmt"
	"math"
	"sort"
	"strings"
	"time"
	"unsafe"

	"distill/compute"
)

// cuDNN's fused flash attention (cudnn_sdpa.c builds the graphs).
//
// The library is optional: Open loads it when the attention mode is auto or
// cudnn, and with auto a missing, too old or failing cuDNN leaves attention
// on this package's kernels, with one log line saying so. Plans are built
// once per shape bucket (samples and the longest sample, each rounded up to
// a power of two; the unused samples of a bucket are empty) and kept for
// the process, so a training run builds a handful, not one per step.

var specCudnn = libSpec{
	what: "cuDNN", env: "DISTILL_LIBCUDNN", names: []string{"libcudnn.so.9"},
	hint: "install cuDNN 9 (pip nvidia-cudnn-cu12 or nvidia-cudnn-cu13, or the CUDA repository's libcudnn9-cuda-12/13), or point DISTILL_LIBCUDNN at libcudnn.so.9",
}

// cudnnMinVersion is the oldest cuDNN whose fused attention runs the graphs
// cudnn_sdpa.c builds: 9.10 is the first that needs no second padding mask
// in the backward (9.0-9.9 do), fills masked scores with -inf, and takes
// ragged GQA backward graphs (9.6).
const cudnnMinVersion = 91000

// cudnnSlowdown is the expected cost of falling back, for the log line:
// the own tensor-core kernels against cuDNN on an H200 (the 2026-11-26
// GPU run: 33.9 against 606 TFLOP/s forward).
const cudnnSlowdown = "about 15x slower"

type cudnnLib struct {
	lib     *library
	api     *C.distill_cudnn_api // C memory: the entry points
	version int
	handle  C.cudnnHandle_t
	plans   map[sdpaKey]*sdpaPlan
	refused map[sdpaKey]string // shapes cuDNN would not plan, with why
	// calls counts the executions, forward and backward (tests check that
	// cuDNN really ran).
	calls [2]int
	// C memory for the variant pack: uids, pointers, and the by-value
	// scalars (scale, -inf, -inf, 1).
	uids, ptrs, scalars unsafe.Pointer
}

// sdpaKey is what a plan is built for (distill_sdpa_key).
type sdpaKey struct {
	bwd, det, dense bool // backward; its deterministic graph; dense workspace tensors
	// fixed: every sample has s tokens, b and s exact (not buckets); the
	// graph without ragged offsets, lengths or padding mask.
	fixed           bool
	b, h, hkv, s, d int // samples (bucket), query heads, kv heads, longest sample (bucket), head_dim
}

func (k sdpaKey) c() C.distill_sdpa_key {
	var c C.distill_sdpa_key
	if k.bwd {
		c.bwd = 1
	}
	if k.det {
		c.det = 1
	}
	if k.dense {
		c.dense_ws = 1
	}
	if k.fixed {
		c.fixed = 1
	}
	c.b, c.h, c.hkv, c.s, c.d = C.int64_t(k.b), C.int64_t(k.h), C.int64_t(k.hkv), C.int64_t(k.s), C.int64_t(k.d)
	return c
}

type sdpaPlan struct {
	key   sdpaKey
	p     *C.distill_sdpa_plan // C memory
	built time.Duration
}

// loadCudnn opens cuDNN, checks its version and creates its handle on b's
// stream (the context must be current).
func (b *Backend) loadCudnn() (*cudnnLib, error) {
	lib, err := openLibrary(specCudnn)
	if err != nil {
		return nil, err
	}
	d := &cudnnLib{lib: lib, plans: map[sdpaKey]*sdpaPlan{}, refused: map[sdpaKey]string{}}
	d.api = (*C.distill_cudnn_api)(C.calloc(1, C.size_t(unsafe.Sizeof(C.distill_cudnn_api{}))))
	ok := false
	defer func() {
		if !ok {
			d.close()
		}
	}()
	if err := lib.bind(map[string]*unsafe.Pointer{
		"cudnnGetVersion":               &d.api.getVersion,
		"cudnnGetErrorString":           &d.api.getErrorString,
		"cudnnCreate":                   &d.api.create,
		"cudnnDestroy":                  &d.api.destroy,
		"cudnnSetStream":                &d.api.setStream,
		"cudnnBackendCreateDescriptor":  &d.api.createDesc,
		"cudnnBackendDestroyDescriptor": &d.api.destroyDesc,
		"cudnnBackendSetAttribute":      &d.api.setAttr,
		"cudnnBackendGetAttribute":      &d.api.getAttr,
		"cudnnBackendFinalize":          &d.api.finalize,
		"cudnnBackendExecute":           &d.api.execute,
	}); err != nil {
		return nil, err
	}
	if p, err := lib.sym("cudnnGetLastErrorString"); err == nil { // 9.0 and newer
		d.api.getLastErrorString = p
	}
	d.version = int(C.call_cudnnGetVersion(d.api.getVersion))
	if d.version < cudnnMinVersion {
		return nil, fmt.Errorf("cuda: cuDNN %s (%s) is older than %s, the first whose fused attention runs this backend's graphs; install a newer cuDNN 9 or point DISTILL_LIBCUDNN at one",
			cudnnVersionString(d.version), lib.path, cudnnVersionString(cudnnMinVersion))
	}
	if st := C.call_cudnnCreate(d.api.create, &d.handle); st != 0 {
		return nil, fmt.Errorf("cuda: cudnnCreate (%s): %s", lib.path, d.status(int(st)))
	}
	if st := C.call_cudnnSetStream(d.api.setStream, d.handle, unsafe.Pointer(b.stream)); st != 0 {
		return nil, fmt.Errorf("cuda: cudnnSetStream: %s", d.status(int(st)))
	}
	d.uids = C.calloc(32, 8)
	d.ptrs = C.calloc(32, 8)
	d.scalars = C.calloc(4, 4)
	sc := unsafe.Slice((*float32)(d.scalars), 4)
	sc[1], sc[2], sc[3] = float32(math.Inf(-1)), float32(math.Inf(-1)), 1
	ok = true
	return d, nil
}

func (d *cudnnLib) status(st int) string {
	s := ""
	if d.api.getErrorString != nil {
		if c := C.call_cudnnGetErrorString(d.api.getErrorString, C.int(st)); c != nil {
			s = C.GoString(c)
		}
	}
	return fmt.Sprintf("status %d (%s)", st, s)
}

// cudnnVersionString turns 91900 into "9.19.0".
func cudnnVersionString(v int) string {
	return fmt.Sprintf("%d.%d.%d", v/10000, v/100%100, v%100)
}

func (d *cudnnLib) close() {
	if d == nil {
		return
	}
	if d.api != nil {
		for _, p := range d.plans {
			C.distill_sdpa_destroy(d.api, p.p)
			C.free(unsafe.Pointer(p.p))
		}
		d.plans = nil
		if d.handle != nil {
			C.call_cudnnDestroy(d.api.destroy, d.handle)
			d.handle = nil
		}
		C.free(unsafe.Pointer(d.api))
		d.api = nil
	}
	for _, p := range []*unsafe.Pointer{&d.uids, &d.ptrs, &d.scalars} {
		if *p != nil {
			C.free(*p)
			*p = nil
		}
	}
	d.lib.close()
}

// AttentionImpl names what runs attention: "cudnn 9.19.0 (deterministic
// backward)" (", ragged graph only" under Options.AttnRaggedOnly), or the
// own kernels ("mma", "simt", "auto").
func (b *Backend) AttentionImpl() string {
	if b.dnn == nil {
		return "own kernels (" + string(b.ownAttn()) + ")"
	}
	det := "deterministic backward"
	if b.attnNondet {
		det = "non-deterministic backward"
	}
	if b.attnRagged {
		det += ", ragged graph only"
	}
	return fmt.Sprintf("cudnn %s (%s)", cudnnVersionString(b.dnn.version), det)
}

// ownAttn is the own kernels' mode: the configured one, or auto when
// cuDNN was asked for.
func (b *Backend) ownAttn() attnMode {
	if b.attn == "cudnn" {
		return "auto"
	}
	return b.attn
}

// pow2 rounds n up to a power of two (at least 1).
func pow2(n int) int {
	p := 1
	for p < n {
		p *= 2
	}
	return p
}

// useCudnn reports whether an attention call goes to cuDNN: the mode
// allows it, cuDNN loaded, and the shape is one its fused attention takes
// (head_dim a multiple of 8 up to 256, element offsets within int32).
func (b *Backend) useCudnn(tokens, nSeq, maxLen, nHead, nKV, hd int) bool {
	if b.dnn == nil || (b.attn != "" && b.attn != "auto" && b.attn != "cudnn") {
		return false
	}
	return tokens > 0 && nSeq > 0 && maxLen > 0 && hd%8 == 0 && hd <= 256 && nHead%nKV == 0 &&
		int64(tokens)*int64(nHead)*int64(hd) < math.MaxInt32
}

// sdpaKeyOf builds the plan key of a call through the ragged graph.
func sdpaKeyOf(bwd, det, dense bool, nSeq, maxLen, nHead, nKV, hd int) sdpaKey {
	return sdpaKey{bwd: bwd, det: det && bwd, dense: dense && bwd, b: pow2(nSeq), h: nHead, hkv: nKV, s: pow2(maxLen), d: hd}
}

// fixedKeyOf builds the plan key of a call whose nSeq samples all have
// maxLen tokens (fixedLengths), through the graph without ragged offsets,
// lengths or padding mask: the bucket's shape, which is the call's.
func fixedKeyOf(bwd, det bool, nSeq, maxLen, nHead, nKV, hd int) sdpaKey {
	return sdpaKey{bwd: bwd, det: det && bwd, fixed: true, b: nSeq, h: nHead, hkv: nKV, s: maxLen, d: hd}
}

// fixedLengths reports whether a call goes through the fixed graph first
// (unless Options.AttnRaggedOnly): its samples all have maxLen tokens
// (tokens = nSeq·maxLen, the samples covering the tokens from the first,
// the contract's starts[0] = 0 and starts[nSeq] = tokens, none longer
// than maxLen), and nSeq and maxLen are powers of two, so that the call
// fills its bucket exactly. Buckets keep the plans few: a plan of each
// exact shape would be one per length of a sample alone in its attention
// group (a long chat sample), each built on the GPU in the step that meets
// it. Training rows of 8192- or 4096-token windows, and the benchmarks'
// batches, fill their buckets.
func (b *Backend) fixedLengths(tokens, nSeq, maxLen int) bool {
	return !b.attnRagged && nSeq > 0 && tokens == nSeq*maxLen && nSeq == pow2(nSeq) && maxLen == pow2(maxLen)
}

// callPlan is the plan of a call: the fixed graph's where the samples
// all have one length (fixed, fixedLengths) and cuDNN takes it, else the
// ragged graph's (with dense workspace tensors where this cuDNN refuses
// ragged ones, for the backward); nil when cuDNN refuses the shape.
func (b *Backend) callPlan(bwd, fixed bool, nSeq, maxLen, nHead, nKV, hd int) *sdpaPlan {
	det := bwd && !b.attnNondet
	if fixed {
		if p := b.sdpaPlan(fixedKeyOf(bwd, det, nSeq, maxLen, nHead, nKV, hd)); p != nil {
			return p
		}
	}
	if p := b.sdpaPlan(sdpaKeyOf(bwd, det, false, nSeq, maxLen, nHead, nKV, hd)); p != nil || !bwd {
		return p
	}
	return b.sdpaPlan(sdpaKeyOf(bwd, det, true, nSeq, maxLen, nHead, nKV, hd))
}

func (k sdpaKey) String() string {
	dir := "forward"
	if k.bwd {
		dir = "backward"
		if k.det {
			dir = "deterministic backward"
		}
		if k.dense {
			dir += " (dense workspace)"
		}
	}
	if k.fixed {
		return fmt.Sprintf("%s, %d samples of %d tokens each (fixed lengths), %d/%d heads, head_dim %d", dir, k.b, k.s, k.h, k.hkv, k.d)
	}
	return fmt.Sprintf("%s, %d samples of up to %d tokens, %d/%d heads, head_dim %d", dir, k.b, k.s, k.h, k.hkv, k.d)
}

// sdpaPlan returns the plan of key, building it on first use (logged with
// its build time), or nil and why when cuDNN refuses the shape (logged
// once; the caller falls back to the own kernels).
func (b *Backend) sdpaPlan(key sdpaKey) *sdpaPlan {
	d := b.dnn
	if p, ok := d.plans[key]; ok {
		return p
	}
	if _, ok := d.refused[key]; ok {
		return nil
	}
	p := &sdpaPlan{key: key, p: (*C.distill_sdpa_plan)(C.calloc(1, C.size_t(unsafe.Sizeof(C.distill_sdpa_plan{}))))}
	var msg [1024]C.char
	t0 := time.Now()
	ck := key.c()
	rc := C.distill_sdpa_build(d.api, d.handle, &ck, p.p, &msg[0], C.int(len(msg)))
	p.built = time.Since(t0)
	if rc != 0 {
		why := C.GoString(&msg[0])
		C.distill_sdpa_destroy(d.api, p.p)
		C.free(unsafe.Pointer(p.p))
		d.refused[key] = why
		if key.fixed {
			b.logf("cuda: cuDNN %s refused the attention %s: %s; this shape runs through the ragged graph",
				cudnnVersionString(d.version), key, why)
		} else {
			b.logf("cuda: cuDNN %s refused the attention %s: %s; this shape runs on the own kernels, %s on Hopper",
				cudnnVersionString(d.version), key, why, cudnnSlowdown)
		}
		return nil
	}
	d.plans[key] = p
	nondet := ""
	if p.p.nondet != 0 {
		nondet = ", non-deterministic"
	}
	b.logf("cuda: cuDNN %s attention plan for the %s built in %v (engine %d%s, workspace %d bytes)",
		cudnnVersionString(d.version), key, p.built.Round(time.Millisecond), int64(p.p.engine), nondet, int64(p.p.workspace))
	return p
}

// AttentionWorkspaceBytes implements compute.AttentionWorkspaceReporter:
// the most device memory cuDNN asks for beside the tensors in an attention
// call of nSeq samples of at most maxLen tokens (its plans' workspace, and
// the non-deterministic backward's fp32 dq accumulator), forward or
// backward; 0 where cuDNN does not run the shape. It builds the two plans
// when they do not exist yet: they are the ones those calls then use.
// cuDNN sizes the workspace per plan, that is per bucket of powers of two
// of nSeq and maxLen, and its deterministic backward's grows as
// nSeq·maxLen² (the decoder keeps a packed row's calls within the bucket
// of one sample of the row's tokens).
func (b *Backend) AttentionWorkspaceBytes(nSeq, maxLen, heads, kvHeads, headDim int) int64 {
	defer b.enter()()
	if !b.useCudnn(nSeq*maxLen, nSeq, maxLen, heads, kvHeads, headDim) {
		return 0
	}
	// The calls of nSeq samples of maxLen tokens each take the fixed
	// graph, those of shorter samples the ragged one: the larger of the two.
	graphs := []bool{false}
	if b.fixedLengths(nSeq*maxLen, nSeq, maxLen) {
		graphs = append(graphs, true)
	}
	var ws int64
	for _, fixed := range graphs {
		if p := b.callPlan(false, fixed, nSeq, maxLen, heads, kvHeads, headDim); p != nil {
			ws = max(ws, int64(p.p.workspace))
		}
		if p := b.callPlan(true, fixed, nSeq, maxLen, heads, kvHeads, headDim); p != nil {
			bw := int64(p.p.workspace)
			if !p.key.det { // the dq accumulator, rows x head_dim fp32
				rows := int64(nSeq) * int64(maxLen) * int64(heads)
				if p.key.dense {
					rows = int64(p.key.b) * int64(heads) * int64(p.key.s)
				}
				bw += rows * int64(headDim) * 4
			}
			ws = max(ws, bw)
		}
	}
	return ws
}

// CudnnPlans lists the plans built so far, for logs and tests.
func (b *Backend) CudnnPlans() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.dnn == nil {
		return nil
	}
	var out []string
	for k, p := range b.dnn.plans {
		out = append(out, fmt.Sprintf("%s: engine %d, workspace %d bytes, built in %v", k, int64(p.p.engine), int64(p.p.workspace), p.built.Round(time.Millisecond)))
	}
	sort.Strings(out)
	return out
}

// sdpaMeta writes cuDNN's per-sample tensors for nSeq samples padded to the
// key's bucket (k_sdpa_meta): element offsets of q/out, of k/v and of the
// stats, and the lengths. It returns the allocation and the four arrays'
// addresses, each 16-byte aligned.
func (b *Backend) sdpaMeta(st *tensor, nSeq int, key sdpaKey) (buf uint64, offQ, offK, offS, lens uint64) {
	nb := key.b
	stride := uint64((nb+1+3)/4*4) * 4
	buf = b.alloc(int64(stride) * 4)
	b.launchKernel(launch{kernel: "k_sdpa_meta", grid: [3]int{1, 1, 1}, block: 256},
		dptr(buf), int32(stride/4), dptr(st.p), int32(nSeq), int32(nb), int32(key.h), int32(key.hkv), int32(key.d))
	return buf, buf, buf + stride, buf + 2*stride, buf + 3*stride
}

// sdpaRagged adds to vp the ragged graph's per-sample tensors
// (sdpaMeta), and returns their allocation; a fixed graph has none (0).
func (b *Backend) sdpaRagged(vp map[int]uint64, st *tensor, nSeq int, key sdpaKey) (meta uint64) {
	if key.fixed {
		return 0
	}
	meta, offQ, offK, offS, lens := b.sdpaMeta(st, nSeq, key)
	vp[C.DISTILL_SDPA_UID_SEQ_Q], vp[C.DISTILL_SDPA_UID_SEQ_KV] = lens, lens
	vp[C.DISTILL_SDPA_UID_OFF_Q], vp[C.DISTILL_SDPA_UID_OFF_KV], vp[C.DISTILL_SDPA_UID_OFF_STATS] = offQ, offK, offS
	return meta
}

// sdpaExec runs plan p with the (uid, pointer) pairs of vp; scale is the
// by-value scale. Failures at execution are not a refusal: the graph
// planned, so a failure is a fault, and panics like a failed kernel.
func (b *Backend) sdpaExec(p *sdpaPlan, vp map[int]uint64, scale float32, what string) {
	d := b.dnn
	sc := unsafe.Slice((*float32)(d.scalars), 4)
	sc[0] = scale
	vp[C.DISTILL_SDPA_UID_SCALE] = uint64(uintptr(d.scalars))
	if !p.key.fixed {
		vp[C.DISTILL_SDPA_UID_NEG_INF_PAD] = uint64(uintptr(d.scalars) + 4)
	}
	vp[C.DISTILL_SDPA_UID_NEG_INF_CAUSAL] = uint64(uintptr(d.scalars) + 8)
	if p.key.bwd {
		vp[C.DISTILL_SDPA_UID_ONE] = uint64(uintptr(d.scalars) + 12)
	}
	uids := unsafe.Slice((*int64)(d.uids), 32)
	ptrs := unsafe.Slice((*uint64)(d.ptrs), 32)
	keys := make([]int, 0, len(vp))
	for u := range vp {
		keys = append(keys, u)
	}
	sort.Ints(keys)
	for i, u := range keys {
		uids[i], ptrs[i] = int64(u), vp[u]
	}
	var ws uint64
	if p.p.workspace > 0 {
		ws = b.alloc(int64(p.p.workspace))
	}
	var msg [1024]C.char
	done := b.timed(what)
	rc := C.distill_sdpa_execute(d.api, d.handle, p.p, C.int(len(keys)), (*C.int64_t)(d.uids), (*unsafe.Pointer)(d.ptrs),
		C.uint64_t(ws), &msg[0], C.int(len(msg)))
	done()
	if p.key.bwd {
		d.calls[1]++
	} else {
		d.calls[0]++
	}
	if ws != 0 {
		b.free(ws)
	}
	if rc != 0 {
		panic(fmt.Errorf("cuda: cuDNN %s: %s", what, strings.TrimSpace(C.GoString(&msg[0]))))
	}
}

// aligned16 reports whether a device address meets the graphs' 16-byte
// tensor alignment (a decoder's tensors may be views at any float offset).
func aligned16(p uint64) bool { return p%16 == 0 }

// bf16Copy rounds n F32 values at p into a new BF16 buffer.
func (b *Backend) bf16Copy(p uint64, n int) uint64 {
	c := b.alloc(int64(n) * 2)
	b.convert("k_f32_to_bf16", c, p, int64(n))
	return c
}

// cudnnAttention runs the forward on cuDNN; false when cuDNN refused the
// shape (the caller runs the own kernels).
func (b *Backend) cudnnAttention(a attnArgs, nSeq, maxLen, tokens, nHead, nKV, hd int, scale float32) bool {
	out, lse, q, k, v, st := a.out, a.lse, a.q, a.k, a.v, a.st
	p := b.callPlan(false, b.fixedLengths(tokens, nSeq, maxLen), nSeq, maxLen, nHead, nKV, hd)
	if p == nil {
		return false
	}
	nq, nk := tokens*nHead*hd, tokens*nKV*hd
	qb, qs := b.bf16In(q, nq)
	kb, ks := b.bf16In(k, nk)
	vb, vs := b.bf16In(v, nk)
	ob, obs := out.p, uint64(0) // cuDNN writes BF16: into out, or a scratch
	if out.dt != compute.BF16 || !aligned16(out.p) {
		obs = b.alloc(int64(nq) * 2)
		ob = obs
	}
	var stats, statsScratch uint64
	statsBytes := int64(tokens) * int64(nHead) * 4
	if lse != nil && aligned16(lse.p) {
		stats = lse.p
	} else {
		statsScratch = b.alloc(statsBytes)
		stats = statsScratch
	}
	vp := map[int]uint64{
		C.DISTILL_SDPA_UID_Q: qb, C.DISTILL_SDPA_UID_K: kb, C.DISTILL_SDPA_UID_V: vb, C.DISTILL_SDPA_UID_O: ob,
		C.DISTILL_SDPA_UID_STATS: stats,
	}
	meta := b.sdpaRagged(vp, st, nSeq, p.key)
	b.sdpaExec(p, vp, scale, "cudnn attention forward")
	switch {
	case obs != 0 && out.dt == compute.F32:
		b.convert("k_bf16_to_f32", out.p, ob, int64(nq))
	case obs != 0:
		b.copyD(out.p, ob, int64(nq)*2)
	}
	if lse != nil && stats != lse.p {
		b.copyD(lse.p, stats, statsBytes)
	}
	for _, x := range []uint64{meta, qs, ks, vs, obs, statsScratch} {
		if x != 0 {
			b.free(x)
		}
	}
	return true
}

// cudnnAttentionBackward runs the backward on cuDNN, accumulating its BF16
// dq, dk, dv into the F32 gradients; false when cuDNN refused the shape
// (nothing is enqueued then). Gradients zeroed for this call (zeros.go)
// get cuDNN's values instead: dq and dk widened, a BF16 dv written by
// cuDNN in place; it flushes the deferred zeros over its other operands.
// The deterministic graph is asked for unless Options.AttnNondeterministic;
// the workspace tensors are ragged over the tokens, or dense [B,H,S,·]
// where this cuDNN refuses ragged ones.
func (b *Backend) cudnnAttentionBackward(a attnBwdArgs, nSeq, maxLen, tokens, nHead, nKV, hd int, scale float32) bool {
	dq, dk, dv, dout, q, k, v, out, lse, st := a.dq, a.dk, a.dv, a.dout, a.q, a.k, a.v, a.out, a.lse, a.st
	p := b.callPlan(true, b.fixedLengths(tokens, nSeq, maxLen), nSeq, maxLen, nHead, nKV, hd)
	if p == nil {
		return false
	}
	key := p.key
	nq, nk := tokens*nHead*hd, tokens*nKV*hd
	zq, zk := b.takeZero(dq.p, int64(nq)*4), b.takeZero(dk.p, int64(nk)*4)
	zv := dv.dt == compute.BF16 && aligned16(dv.p) && b.takeZero(dv.p, int64(nk)*2)
	if !zv && dv.dt == compute.F32 {
		zv = b.takeZero(dv.p, int64(nk)*4)
	}
	b.flushZerosOver(a.operands()...)
	qb, qs := b.bf16In(q, nq)
	kb, ks := b.bf16In(k, nk)
	vb, vs := b.bf16In(v, nk)
	ob, obs := b.bf16In(out, nq)
	dob, dobs := b.bf16In(dout, nq) // a BF16 dout (o_proj's BF16 dx) read in place
	dqb, dkb := b.alloc(int64(nq)*2), b.alloc(int64(nk)*2)
	dvb := dv.p // a zeroed BF16 dv: cuDNN's output itself
	if !zv || dv.dt != compute.BF16 {
		dvb = b.alloc(int64(nk) * 2)
	}
	rows := int64(tokens) * int64(nHead) // the workspace tensors' rows
	if key.dense {
		rows = int64(key.b) * int64(nHead) * int64(key.s)
	}
	ssum := b.alloc(rows * 4)
	stats, statsScratch := lse.p, uint64(0)
	if !aligned16(stats) {
		statsScratch = b.alloc(int64(tokens) * int64(nHead) * 4)
		b.copyD(statsScratch, stats, int64(tokens)*int64(nHead)*4)
		stats = statsScratch
	}
	vp := map[int]uint64{
		C.DISTILL_SDPA_UID_Q: qb, C.DISTILL_SDPA_UID_K: kb, C.DISTILL_SDPA_UID_V: vb, C.DISTILL_SDPA_UID_O: ob,
		C.DISTILL_SDPA_UID_DO: dob, C.DISTILL_SDPA_UID_DQ: dqb, C.DISTILL_SDPA_UID_DK: dkb, C.DISTILL_SDPA_UID_DV: dvb,
		C.DISTILL_SDPA_UID_STATS: stats, C.DISTILL_SDPA_UID_SOFTMAX_SUM: ssum,
	}
	meta := b.sdpaRagged(vp, st, nSeq, key)
	var acc uint64
	if !key.det {
		acc = b.alloc(rows * int64(hd) * 4)
		vp[C.DISTILL_SDPA_UID_DQ_ACCUM] = acc
	}
	b.sdpaExec(p, vp, scale, "cudnn attention backward")
	// Into the contract's gradients: added, or (zeroed) widened.
	into := func(dst, src uint64, n int, zero bool) {
		if zero {
			b.convert("k_bf16_to_f32", dst, src, int64(n))
		} else {
			b.convert("k_add_bf16", dst, src, int64(n))
		}
	}
	into(dq.p, dqb, nq, zq)
	into(dk.p, dkb, nk, zk)
	switch {
	case dv.dt == compute.F32:
		into(dv.p, dvb, nk, zv)
	case !zv:
		b.convert("k_add_bf16_act", dv.p, dvb, int64(nk)) // v_proj's backward reads it: no widening
	}
	if dvb == dv.p {
		dvb = 0 // not a scratch
	}
	for _, x := range []uint64{meta, qs, ks, vs, obs, dobs, dqb, dkb, dvb, ssum, acc, statsScratch} {
		if x != 0 {
			b.free(x)
		}
	}
	return true
}
