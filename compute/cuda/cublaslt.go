package cuda

/*
#include "capi.h"
*/
import "C"

import (
	"fmt"
	"unsafe"
)

// cuBLASLt constants (cublasLt.h, library_types.h), declared by hand.
const (
	computeF32 = 68 // CUBLAS_COMPUTE_32F: fp32 accumulation, no TF32

	dataF32  = 0  // CUDA_R_32F
	dataBF16 = 14 // CUDA_R_16BF

	opN = 0 // CUBLAS_OP_N
	opT = 1 // CUBLAS_OP_T

	descTransA = 3 // CUBLASLT_MATMUL_DESC_TRANSA
	descTransB = 4 // CUBLASLT_MATMUL_DESC_TRANSB

	descAScalePointer = 17 // CUBLASLT_MATMUL_DESC_A_SCALE_POINTER
	descBScalePointer = 18 // CUBLASLT_MATMUL_DESC_B_SCALE_POINTER
	descFastAccum     = 25 // CUBLASLT_MATMUL_DESC_FAST_ACCUM (int8_t)
	descAScaleMode    = 31 // CUBLASLT_MATMUL_DESC_A_SCALE_MODE (cuBLAS 12.8 and later)
	descBScaleMode    = 32 // CUBLASLT_MATMUL_DESC_B_SCALE_MODE
	scaleOuterVec32F  = 3  // CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F

	// ltOuterVecVersion is the first cuBLASLt (cublasLtGetVersion: major·10000
	// + minor·100 + patch) with FP8 outer-vector scales on Hopper: 12.9.
	ltOuterVecVersion = 120900

	prefMaxWorkspace = 1 // CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES
	prefReduction    = 3 // CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK

	reductionComputeType = 2 // CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE (NONE is 0: always allowed)
	prefMinAlignA        = 5 // CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES (B, C, D follow)

	gemmWorkspaceBytes = 32 << 20 // cuBLASLt's advice for Hopper
)

// cublasLt is the cuBLASLt library, reached through function pointers.
type cublasLt struct {
	lib     *library
	version int

	create, destroy, getVersion, getStatusString                  unsafe.Pointer
	descCreate, descDestroy, descSetAttr                          unsafe.Pointer
	layoutCreate, layoutDestroy, prefCreate, prefDestroy, prefSet unsafe.Pointer
	heuristic, matmul                                             unsafe.Pointer
}

// loadCublasLt opens libcublasLt (newest soname first) and binds its entry
// points; a missing library or symbol is an error naming it.
func loadCublasLt() (*cublasLt, error) {
	lib, err := openLibrary(specCublasLt)
	if err != nil {
		return nil, err
	}
	l := &cublasLt{lib: lib}
	if err := lib.bind(map[string]*unsafe.Pointer{
		"cublasLtCreate":                       &l.create,
		"cublasLtDestroy":                      &l.destroy,
		"cublasLtGetVersion":                   &l.getVersion,
		"cublasLtGetStatusString":              &l.getStatusString,
		"cublasLtMatmulDescCreate":             &l.descCreate,
		"cublasLtMatmulDescDestroy":            &l.descDestroy,
		"cublasLtMatmulDescSetAttribute":       &l.descSetAttr,
		"cublasLtMatrixLayoutCreate":           &l.layoutCreate,
		"cublasLtMatrixLayoutDestroy":          &l.layoutDestroy,
		"cublasLtMatmulPreferenceCreate":       &l.prefCreate,
		"cublasLtMatmulPreferenceDestroy":      &l.prefDestroy,
		"cublasLtMatmulPreferenceSetAttribute": &l.prefSet,
		"cublasLtMatmulAlgoGetHeuristic":       &l.heuristic,
		"cublasLtMatmul":                       &l.matmul,
	}); err != nil {
		lib.close()
		return nil, err
	}
	l.version = int(C.call_cublasLtGetVersion(l.getVersion))
	return l, nil
}

func (l *cublasLt) check(call string, s C.cublasStatus_t) error {
	if s == 0 {
		return nil
	}
	msg := "unknown status"
	if p := C.call_cublasLtGetStatusString(l.getStatusString, s); p != nil {
		msg = C.GoString(p)
	}
	return fmt.Errorf("cuda: %s failed: %s (%d)", call, msg, int(s))
}

// gemmShape is one row-major product out (m,n) (F32, or BF16: out) = op(a) (m,k) ·
// op(b) (k,n) with a and b of type in (dataBF16, dataF32, or dataE4M3 in
// the forward's layout only: fp8.go), op(a) = aᵀ
// when ta (a stored (k,m)), op(b) = bᵀ when tb (b stored (n,k)), and the
// alignment in bytes (a power of two, at most 256) of its pointers, which
// cuBLASLt's choice of algorithm depends on. The forward's x·wᵀ is
// ta = false, tb = true.
type gemmShape struct {
	m, n, k int
	in      int
	out     int // the type of out: dataF32 (0), or dataBF16
	ta, tb  bool
	align   [4]int // A (b), B (a), C, D (out)
	// outerVec: an FP8 GEMM whose D is scaled by a vector per operand
	// (CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F): D[r][c] = Σ · as[r]
	// · ws[c] for out's row r and column c, the vectors set at each run
	// (runScaled). fp8.go.
	outerVec bool
	// fastAccum: an FP8 GEMM with CUBLASLT_MATMUL_DESC_FAST_ACCUM on
	// (Options.FP8FastAccum; fp8.go).
	fastAccum bool
}

// testGemmNoSplitK makes every cuBLASLt plan made after it is set one
// without split-K (tests: does a difference come from split-K?).
var testGemmNoSplitK bool

// gemmPlan is a cuBLASLt descriptor set with its chosen algorithm.
type gemmPlan struct {
	desc       C.cublasLtMatmulDesc_t
	la, lb, lc C.cublasLtMatrixLayout_t
	algo       C.distill_heuristic
}

// The mapping from row-major to cuBLASLt's column-major: out (m,n) row-major
// is D (n,m) column-major with ld n, and D = op(b)ᵀ·op(a)ᵀ, so cuBLASLt's A
// is b and its B is a. b stored (n,k) (tb) is A (k,n) column-major with ld
// k, used transposed; b stored (k,n) is A (n,k) with ld n, used as is. a
// stored (m,k) is B (k,m) with ld k, used as is; a stored (k,m) (ta) is B
// (m,k) with ld m, used transposed. The forward's x·wᵀ is D = Aᵀ·B, the
// "TN" GEMM tensor cores like; the backward's dx = dout·w is "NN" and
// dw = doutᵀ·x is "NT".
func (l *cublasLt) plan(h C.cublasLtHandle_t, s gemmShape) (*gemmPlan, error) {
	p := &gemmPlan{}
	ok := false
	defer func() {
		if !ok {
			l.destroyPlan(p)
		}
	}()
	if err := l.check("cublasLtMatmulDescCreate", C.call_cublasLtMatmulDescCreate(l.descCreate, &p.desc, computeF32, dataF32)); err != nil {
		return nil, err
	}
	ta, tb := C.int(opN), C.int(opN)
	if s.tb {
		ta = opT
	}
	if s.ta {
		tb = opT
	}
	if err := l.check("cublasLtMatmulDescSetAttribute(TRANSA)", C.call_cublasLtSetAttribute(l.descSetAttr, unsafe.Pointer(p.desc), descTransA, unsafe.Pointer(&ta), 4)); err != nil {
		return nil, err
	}
	if err := l.check("cublasLtMatmulDescSetAttribute(TRANSB)", C.call_cublasLtSetAttribute(l.descSetAttr, unsafe.Pointer(p.desc), descTransB, unsafe.Pointer(&tb), 4)); err != nil {
		return nil, err
	}
	if s.fastAccum {
		v := C.int8_t(1)
		if err := l.check("cublasLtMatmulDescSetAttribute(FAST_ACCUM)", C.call_cublasLtSetAttribute(l.descSetAttr, unsafe.Pointer(p.desc), descFastAccum, unsafe.Pointer(&v), 1)); err != nil {
			return nil, err
		}
	}
	if s.outerVec {
		// Both operands' modes (cuBLASLt: both or neither): its A is the
		// weight (a scale per output channel, its M = our n), its B the
		// activations (a scale per row, its N = our m).
		mode := C.int32_t(scaleOuterVec32F)
		for _, attr := range []C.int{descAScaleMode, descBScaleMode} {
			if err := l.check("cublasLtMatmulDescSetAttribute(SCALE_MODE OUTER_VEC_32F)", C.call_cublasLtSetAttribute(l.descSetAttr, unsafe.Pointer(p.desc), attr, unsafe.Pointer(&mode), 4)); err != nil {
				return nil, err
			}
		}
	}
	mk := func(dst *C.cublasLtMatrixLayout_t, typ, rows, cols, ld int) error {
		return l.check("cublasLtMatrixLayoutCreate", C.call_cublasLtMatrixLayoutCreate(l.layoutCreate, dst, C.int(typ), C.uint64_t(rows), C.uint64_t(cols), C.int64_t(ld)))
	}
	ar, ac := s.n, s.k // b stored (k,n)
	if s.tb {
		ar, ac = s.k, s.n // b stored (n,k)
	}
	br, bc := s.k, s.m // a stored (m,k)
	if s.ta {
		br, bc = s.m, s.k // a stored (k,m)
	}
	if err := mk(&p.la, s.in, ar, ac, ar); err != nil {
		return nil, err
	}
	if err := mk(&p.lb, s.in, br, bc, br); err != nil {
		return nil, err
	}
	if err := mk(&p.lc, s.out, s.n, s.m, s.n); err != nil {
		return nil, err
	}
	var pref C.cublasLtMatmulPreference_t
	if err := l.check("cublasLtMatmulPreferenceCreate", C.call_cublasLtMatmulPreferenceCreate(l.prefCreate, &pref)); err != nil {
		return nil, err
	}
	defer C.call_cublasLtDestroyDesc(l.prefDestroy, unsafe.Pointer(pref))
	ws := C.uint64_t(gemmWorkspaceBytes)
	if err := l.check("cublasLtMatmulPreferenceSetAttribute(MAX_WORKSPACE_BYTES)", C.call_cublasLtSetAttribute(l.prefSet, unsafe.Pointer(pref), prefMaxWorkspace, unsafe.Pointer(&ws), 8)); err != nil {
		return nil, err
	}
	// The operands' real alignments, so that the heuristic does not pick an
	// algorithm that assumes 256 bytes for an offset pointer. Best effort: a
	// cuBLASLt without these attributes chooses as it would anyway.
	for i, a := range s.align {
		v := C.uint32_t(a)
		C.call_cublasLtSetAttribute(l.prefSet, unsafe.Pointer(pref), C.int(prefMinAlignA+i), unsafe.Pointer(&v), 4)
	}
	// A BF16 D is the fp32 sum rounded once: no split-K algorithm whose
	// partial sums meet in D's type (in place or in an output-typed
	// workspace), which would round each partial. The likely cause of
	// the H200's BF16 dx 2 BF16 steps from the F32 dx's rounding
	// (2026-11-27, TestMatMulBackwardBF16DX). Split-K summing in fp32
	// stays allowed. testGemmNoSplitK forbids split-K altogether.
	if s.out == dataBF16 || testGemmNoSplitK {
		v := C.uint32_t(reductionComputeType)
		if testGemmNoSplitK {
			v = 0
		}
		if err := l.check("cublasLtMatmulPreferenceSetAttribute(REDUCTION_SCHEME_MASK)", C.call_cublasLtSetAttribute(l.prefSet, unsafe.Pointer(pref), prefReduction, unsafe.Pointer(&v), 4)); err != nil {
			return nil, err
		}
	}
	var got C.int
	if err := l.check("cublasLtMatmulAlgoGetHeuristic", C.call_cublasLtMatmulAlgoGetHeuristic(l.heuristic, h, p.desc, p.la, p.lb, p.lc, p.lc, pref, 1, &p.algo, &got)); err != nil {
		return nil, fmt.Errorf("%w (GEMM m=%d n=%d k=%d, %s inputs)", err, s.m, s.n, s.k, typeName(s.in))
	}
	if got < 1 {
		return nil, fmt.Errorf("cuda: cuBLASLt has no algorithm for the GEMM m=%d n=%d k=%d with %s inputs and alignments %v", s.m, s.n, s.k, typeName(s.in), s.align)
	}
	ok = true
	return p, nil
}

func (l *cublasLt) destroyPlan(p *gemmPlan) {
	if p.desc != nil {
		C.call_cublasLtDestroyDesc(l.descDestroy, unsafe.Pointer(p.desc))
	}
	for _, x := range []C.cublasLtMatrixLayout_t{p.la, p.lb, p.lc} {
		if x != nil {
			C.call_cublasLtDestroyDesc(l.layoutDestroy, unsafe.Pointer(x))
		}
	}
	*p = gemmPlan{}
}

// runC enqueues out = op(a)·op(b) + beta·c on stream with plan p (c of
// out's layout; c = out accumulates in place).
func (l *cublasLt) runC(h C.cublasLtHandle_t, p *gemmPlan, out, c, x, w, ws uint64, beta float32, stream C.CUstream) error {
	alpha, cbeta := C.float(1), C.float(beta)
	return l.check("cublasLtMatmul", C.call_cublasLtMatmul(l.matmul, h, p.desc, unsafe.Pointer(&alpha), C.CUdeviceptr(w), p.la,
		C.CUdeviceptr(x), p.lb, unsafe.Pointer(&cbeta), C.CUdeviceptr(c), p.lc, C.CUdeviceptr(out), p.lc, &p.algo,
		C.CUdeviceptr(ws), gemmWorkspaceBytes, stream))
}

// runScaled is runC (beta 0) for an outerVec plan: out = (op(a)·op(b))[r][c] ·
// as[r] · ws[c], as (m) and ws (n) fp32 on the device. The scale pointers
// are the descriptor's attributes, set before each run (the plan is the
// backend's, used one call at a time).
func (l *cublasLt) runScaled(h C.cublasLtHandle_t, p *gemmPlan, out, x, w, as, ws, work uint64, stream C.CUstream) error {
	wp, xp := C.uint64_t(ws), C.uint64_t(as)
	if err := l.check("cublasLtMatmulDescSetAttribute(A_SCALE_POINTER)", C.call_cublasLtSetAttribute(l.descSetAttr, unsafe.Pointer(p.desc), descAScalePointer, unsafe.Pointer(&wp), 8)); err != nil {
		return err
	}
	if err := l.check("cublasLtMatmulDescSetAttribute(B_SCALE_POINTER)", C.call_cublasLtSetAttribute(l.descSetAttr, unsafe.Pointer(p.desc), descBScalePointer, unsafe.Pointer(&xp), 8)); err != nil {
		return err
	}
	return l.runC(h, p, out, out, x, w, work, 0, stream)
}

// typeBytes is the element size of a cuBLASLt type.
func typeBytes(t int) int {
	switch t {
	case dataBF16:
		return 2
	case dataE4M3:
		return 1
	}
	return 4
}

func typeName(t int) string {
	switch t {
	case dataBF16:
		return "bf16"
	case dataF32:
		return "f32"
	case dataE4M3:
		return "e4m3"
	}
	return fmt.Sprintf("cudaDataType(%d)", t)
}

// alignOf is the largest power of two (at most 256) dividing p.
func alignOf(p uint64) int {
	a := 256
	for a > 1 && p%uint64(a) != 0 {
		a /= 2
	}
	return a
}
