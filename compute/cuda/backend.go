package cuda

/*
#include "capi.h"
*/
import "C"

import (
	"fmt"
	"os"
	"runtime"
	"sort"
	"strings"
	"sync"
	"time"
	"unsafe"

	"distill/compute"
	"distill/internal/cli"
)

// Options configure Open.
type Options struct {
	// Device is the GPU's ordinal (0: the first).
	Device int
	// KernelCache is the directory of compiled kernels; "" picks
	// $DISTILL_KERNEL_CACHE or the user cache directory, "off" disables it.
	KernelCache string
	// Attention picks the attention implementation: "cudnn" (cuDNN's fused
	// flash attention; Open fails without a usable cuDNN), "mma" or "simt"
	// (this package's tensor-core or fp32 kernels), or "" / "auto": cuDNN
	// when it loads, else mma where it applies. Shapes cuDNN refuses run on
	// the own kernels either way. $DISTILL_CUDA_ATTN sets it too.
	Attention string
	// AttentionBackward, "mma", runs the attention's backward on this
	// package's tensor-core kernels while the forward runs on Attention's
	// choice, for head_dim 64 and 128 (the others follow Attention); ""
	// follows Attention. An experiment's switch, slower where measured: on
	// an H200, a Qwen3-0.6B training row of 8192 tokens spent 47 ms a step
	// in cuDNN's deterministic backward (about 400 TFLOP/s) and 100 ms in
	// the own kernels. $DISTILL_CUDA_ATTN_BWD sets it too.
	AttentionBackward string
	// AttnNondeterministic lets cuDNN's attention backward use its faster
	// non-deterministic engines (atomic dq accumulation): a resumed run then
	// no longer repeats the uninterrupted one bit for bit.
	// $DISTILL_CUDNN_NONDETERMINISTIC=1 sets it too.
	AttnNondeterministic bool
	// AttnRaggedOnly sends every cuDNN attention call through the ragged
	// graph (per-sample offsets, lengths and the padding mask), also a
	// call whose samples all have the same length, which otherwise gets
	// the plain strided graph (cudnn_sdpa.c: fixed): an experiment's
	// switch, for the GPU suite's side-by-side timing of the two.
	// $DISTILL_CUDNN_RAGGED=1 sets it too.
	AttnRaggedOnly bool
	// Logf, if set, receives one line per notable event (kernels compiled
	// or read from the cache, the device found).
	Logf func(format string, args ...any)
	// Profile times every kernel, GEMM, device-to-device copy ("memcpy
	// DtoD") and memset with events on the stream (recording two a call
	// costs the host a little); Profile() reports the totals, ProfileSpan
	// the time they spread over. For benchmarks, and the tests' counts of
	// launches.
	Profile bool
	// PerUseCasts turns the weight shadows off (shadow.go): every GEMM
	// rounds its fp32 weight operand to BF16 as it reads it, and every
	// FakeQuantNVFP4 runs. The results are the same bits either way; the
	// tests compare the two. $DISTILL_CUDA_PER_USE_CASTS=1 sets it too.
	PerUseCasts bool
	// Activations is the activation dtype the backend asks the decoder for
	// (compute.Backend.ActDType): "bf16" (the default, "") or "f32" (the
	// fp32 activations of earlier versions: twice the memory, a rounding
	// pass before every GEMM; for comparisons). $DISTILL_CUDA_ACT sets it
	// too.
	Activations string
	// Pageable turns the pinned staging of copies off (staging.go):
	// uploads go from Go's memory (the driver stages them, and may wait
	// for the stream), and a loss's values are read with a
	// synchronization, as before the staging. The same bits either way;
	// for comparisons. $DISTILL_CUDA_PAGEABLE=1 sets it too.
	Pageable bool
	// RecomputeLogits makes the loss head's pass 2 compute its logits
	// again where the caller lets it keep pass 1's (compute.LossHead.Keep):
	// the same bits either way; for the GPU suite's comparison.
	// $DISTILL_CUDA_RECOMPUTE_LOGITS=1 sets it too.
	RecomputeLogits bool
	// EagerZeros makes each Zero its memset at once, as before the
	// deferred zeros (zeros.go): the next call then adds to the zeroed
	// buffer instead of writing it. The same values either way; for
	// comparisons. $DISTILL_CUDA_EAGER_ZEROS=1 sets it too.
	EagerZeros bool
	// F32Grads keeps every gradient in F32 under BF16 activations
	// (compute.ActGrads' GradDType): the decoder then hands the backward
	// GEMMs F32 gradients, which MatMulBackward rounds to BF16 in a pass
	// of its own before each GEMM, as before the gradients' producers
	// wrote BF16. The same bits either way (the producers round the same
	// fp32 values once); the tests compare the two, and the GPU suite
	// times them. $DISTILL_CUDA_F32_GRADS=1 sets it too.
	F32Grads bool
	// MoEGEMM picks the experts' grouped GEMM kernels: "" (the default:
	// 64-wide K steps in three shared buffers, the tokens read in place,
	// gate and up fused with the SwiGLU where nothing keeps them) or "v1"
	// (the earlier kernels: 32-wide steps in two buffers, the tokens
	// gathered first, the SwiGLU a pass of its own). The same bits either
	// way; for an A/B on a device. $DISTILL_CUDA_MOE_GEMM sets it too. A
	// GPU whose blocks cannot opt in to the default kernels' 108 KB of
	// shared memory (Ada's 99 KB) runs v1.
	MoEGEMM string
	// FP8Scale picks where an FP8 MatMul multiplies its sums by the rows'
	// and channels' scales (fp8.go): "" or "outer" (the default: in
	// cuBLASLt's epilogue, through outer-vector scales, where cuBLASLt is
	// 12.9 or later, else as "epilogue", logged) or "epilogue" (the GEMM
	// writes fp32 sums and k_fp8_scale scales them, a pass of its own).
	// Both passed TestMatMulFP8Conformance and gave the goldens the same
	// figures on the H200 (2026-11-28), the outer vectors at 1.008x the
	// pass's speed on the Qwen3-8B forward and without the fp32 sums'
	// scratch. $DISTILL_CUDA_FP8_SCALE sets it too.
	FP8Scale string
	// FP8FastAccum turns cuBLASLt's FAST_ACCUM on for the FP8 GEMMs
	// (fp8.go): faster on Hopper, with the tensor cores' narrower
	// accumulator over the whole k. Off by default; for measuring speed
	// and fidelity on a device. $DISTILL_CUDA_FP8_FAST_ACCUM=1 sets it too.
	FP8FastAccum bool
	// RMSNormDW picks how RMSNorm's backward sums dw: "" (the default: the
	// 8-wide row kernels add dw's terms as they go, from the dout and x
	// they hold, into float64 partials per fixed group of rows, which a
	// second kernel adds in order) or "colsum" (the row kernels write dx
	// only, and k_colsum_part4 reads dout and x again for dw, as before).
	// The same terms, added in another fixed order; for an A/B on a
	// device. $DISTILL_CUDA_RMSNORM_DW sets it too. Shapes the 8-wide
	// kernels do not take run the column sums either way.
	RMSNormDW string
	// LMFold picks the LM head's fold kernel (lmhead.cu): "" (the
	// default: k_lm_fold, a launch per LM_TILE-column piece) or "gemm"
	// (k_lm_fold_gemm, one launch per GEMM tile that keeps the row's
	// state on chip across its pieces and selects a piece's best k by
	// radix). The same bits either way. k_lm_fold_gemm was the slower on
	// the H200 (2026-11-28: 0.82x and 0.89x on BenchmarkLMHead, 0.99x on
	// Qwen3-8B's forward), so it is opt-in, for an A/B on a device.
	// $DISTILL_CUDA_LM_FOLD sets it too. A top-k larger than LM_TILE/2
	// (2048) folds by pieces either way.
	LMFold string
	// MemoryCap, when positive, makes the device look this many bytes
	// large: Open allocates the rest of it (the device's total less
	// MemoryCap) outside the pool and holds it until Close, so that this
	// process's context, workspace, pool and tensors fit in MemoryCap, as
	// on a device of that size, and MemInfo and Info report MemoryCap as
	// the total. It checks on a large GPU that a job fits a smaller one
	// (an 80 GB H100's memory on an H200). $DISTILL_CUDA_MEMORY_CAP (a
	// size such as 78GiB) sets it too.
	MemoryCap int64
	// ResidualAdd picks where a decoder's residual connection adds o_proj's
	// and down_proj's outputs to the residual stream: "" (the default:
	// in the GEMM's epilogue, MatMulResidual) or "separate" (the GEMM
	// writes its product, and AddRMSNorm or Add adds it, as before). The
	// same sums; for an A/B on a device. $DISTILL_CUDA_RESIDUAL_ADD sets it
	// too.
	ResidualAdd string
}

// Backend is the CUDA backend. It is safe for concurrent use, one call at
// a time: calls hold a mutex and run on the calling goroutine's OS thread,
// locked for the call, with the device's primary context current.
type Backend struct {
	mu     sync.Mutex
	drv    *driver
	nv     *nvrtc
	lt     *cublasLt
	info   DeviceInfo
	arch   string
	dev    C.CUdevice
	ctx    C.CUcontext
	stream C.CUstream
	// side is the second stream (side.go), made on first use; main holds
	// b.stream while Beside points b.stream at side (besideOn).
	side, main C.CUstream
	besideOn   bool
	evPlain    []C.CUevent    // events without timing, for reuse (side.go)
	pool       C.CUmemoryPool // the device's default pool, which alloc draws from
	ltH        C.cublasLtHandle_t
	ws         uint64 // cuBLASLt workspace
	mods       []C.CUmodule
	fns        map[string]C.CUfunction
	smem       map[string]int // dynamic shared memory each kernel opted in to
	plans      map[gemmShape]*gemmPlan
	attn       attnMode
	dnn        *cudnnLib // nil: attention on the own kernels
	logf       func(string, ...any)

	attnNondet   bool          // Options.AttnNondeterministic
	attnRagged   bool          // Options.AttnRaggedOnly
	attnBwd      attnMode      // Options.AttentionBackward
	act          compute.DType // Options.Activations
	f32Grads     bool          // Options.F32Grads
	moeKernels   string        // Options.MoEGEMM
	fp8OuterVec  bool          // FP8 GEMMs scale in cuBLASLt's epilogue (Options.FP8Scale; fp8.go)
	fp8FastAccum bool          // Options.FP8FastAccum
	rmsColsum    bool          // Options.RMSNormDW "colsum"
	lmFoldGEMM   bool          // Options.LMFold "gemm"
	sepResidual  bool          // Options.ResidualAdd "separate"
	ballast      uint64        // Options.MemoryCap's hold on the rest of the device (0: none)
	memCap       int64         // Options.MemoryCap (0: none)
	pageable     bool          // Options.Pageable
	noKeep       bool          // Options.RecomputeLogits
	kept         *keptLogits   // pass 1's logits, kept for pass 2 (train.go)
	keptW        *keptWeight   // pass 1's BF16 copy of W, kept for pass 2 (train.go)
	eagerZeros   bool          // Options.EagerZeros
	zeros        []zeroRange   // the deferred zeros (zeros.go)

	prof   map[string]*ProfileEntry // nil unless Options.Profile
	label  string                   // the running method, for the profile
	marks  []profMark               // timed calls not read yet
	evFree []C.CUevent              // events for reuse
	span   time.Duration            // ProfileSpan
	tl     HostTimeline             // the host's side while profiling (hostwait.go)

	args        unsafe.Pointer // C memory: argument slots and the pointers to them
	checkParams unsafe.Pointer // the emulator's launch check; nil on a real driver

	// Copies of weights in the form a kernel needs, made once: BF16 copies
	// of F32 weights (GEMM operands) and F32 copies of BF16 MoE routers.
	bf16Of, f32Of map[*tensor]*tensor
	// The BF16 shadows of the fp32 parameters (shadow.go).
	shadow shadows
	// peer: copies from other backends (peer.go).
	peer peerState
	// callScratch: the device memory the call in progress allocated and
	// has neither freed nor kept (alloc), freed if it panics (enter).
	callScratch []uint64
	// waits counts host waits under CountHostWaits (hostwait.go); nil: off.
	waits hostWaits
	// stage is the pinned memory copies go through (staging.go).
	stage staging

	closed bool
}

var (
	_ compute.Backend      = (*Backend)(nil)
	_ compute.DeviceMemory = (*Backend)(nil)
	_ compute.CrossCopier  = (*Backend)(nil)
	_ compute.DeviceNamer  = (*Backend)(nil)
	_ compute.ActGrads     = (*Backend)(nil)
)

const maxArgs = 32

// Open loads the CUDA driver, NVRTC and cuBLASLt, creates a stream on the
// device's primary context and compiles (or reads from the kernel cache)
// every kernel. Each failure names what is missing: libcuda.so.1 on a
// machine without the NVIDIA driver, a library or a symbol, no device, a
// GPU older than compute capability 8.0.
func Open(opt Options) (*Backend, error) {
	logf := opt.Logf
	if logf == nil {
		logf = func(string, ...any) {}
	}
	drv, err := loadDriver()
	if err != nil {
		return nil, err
	}
	b := &Backend{drv: drv, logf: logf, fns: map[string]C.CUfunction{}, smem: map[string]int{},
		plans: map[gemmShape]*gemmPlan{}, bf16Of: map[*tensor]*tensor{}, f32Of: map[*tensor]*tensor{}}
	ok := false
	defer func() {
		if !ok {
			b.release()
		}
	}()
	if err := drv.check("cuInit", C.call_cuInit(drv.cuInit, 0)); err != nil {
		return nil, fmt.Errorf("%w (is an NVIDIA GPU visible to this process?)", err)
	}
	var count C.int
	if err := drv.check("cuDeviceGetCount", C.call_cuDeviceGetCount(drv.cuDeviceGetCount, &count)); err != nil {
		return nil, err
	}
	if int(count) == 0 {
		return nil, fmt.Errorf("cuda: the driver (%s) sees no GPU", drv.lib.path)
	}
	if opt.Device < 0 || opt.Device >= int(count) {
		return nil, &NoDeviceError{Device: opt.Device, Count: int(count)}
	}
	if b.info, err = drv.deviceInfo(opt.Device); err != nil {
		return nil, err
	}
	if b.info.Major < 8 {
		return nil, fmt.Errorf("cuda: %s has compute capability %d.%d; this backend needs 8.0 (Ampere) or newer for BF16 tensor cores", b.info.Name, b.info.Major, b.info.Minor)
	}
	if b.nv, err = loadNVRTC(); err != nil {
		return nil, err
	}
	b.arch = b.info.Arch()
	if !b.nv.supportsArch(b.arch) {
		b.arch = strings.TrimSuffix(b.arch, "a") // NVRTC 11 knows sm_90, not sm_90a
		logf("cuda: NVRTC %s cannot target %sa; compiling for %s (no wgmma)", b.nv.Version(), b.arch, b.arch)
	}
	if b.lt, err = loadCublasLt(); err != nil {
		return nil, err
	}
	if p, err := drv.lib.sym("distill_emu_check_params"); err == nil {
		b.checkParams = p
	}
	if p, err := drv.lib.sym("distill_emu_host_access"); err == nil {
		b.stage.hostCheck = p
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := b.startContext(opt.Device); err != nil {
		return nil, err
	}
	b.args = C.malloc(C.size_t(maxArgs * 16))
	if err := b.setOptions(opt); err != nil {
		return nil, err
	}
	if err := b.capMemory(opt.MemoryCap); err != nil {
		return nil, err
	}
	dir := opt.KernelCache
	if dir == "" {
		dir = defaultCacheDir()
	} else if dir == "off" {
		dir = ""
	}
	if err := b.loadKernels(&kernelCache{dir: dir}); err != nil {
		return nil, err
	}
	if b.attn == "" || b.attn == "auto" || b.attn == "cudnn" {
		if b.dnn, err = b.loadCudnn(); err != nil {
			if b.attn == "cudnn" {
				return nil, err
			}
			logf("cuda: attention runs on this package's kernels, %s than on cuDNN on Hopper: %v", cudnnSlowdown, err)
		}
	}
	logf("cuda: %s (sm_%d%d, %d SMs, %.1f GiB), driver %d, NVRTC %s, cuBLASLt %d, kernels for %s, attention: %s, activations: %v",
		b.info.Name, b.info.Major, b.info.Minor, b.info.SMs, float64(b.info.TotalMem)/(1<<30), b.info.DriverVersion,
		b.nv.Version(), b.lt.version, b.arch, b.AttentionImpl(), b.act)
	ok = true
	return b, nil
}

// altOption reads a switch with one alternative to the default (for an
// A/B on a device): the option's value v, else $env; "" is the default
// (false), alt the alternative (true), anything else an error naming
// what and the two choices (def says what the default is).
func altOption(what, v, env, alt, def string) (bool, error) {
	if v == "" {
		v = os.Getenv(env)
	}
	switch v {
	case "":
		return false, nil
	case alt:
		return true, nil
	}
	return false, fmt.Errorf("cuda: %s %q: want %s, or none for %s", what, v, alt, def)
}

// capMemory holds all but capBytes of the device (Options.MemoryCap;
// $DISTILL_CUDA_MEMORY_CAP when capBytes is 0) in one allocation outside
// the stream-ordered pool, which PeakMemory does not count.
func (b *Backend) capMemory(capBytes int64) error {
	what := "Options.MemoryCap"
	if capBytes == 0 {
		env := os.Getenv("DISTILL_CUDA_MEMORY_CAP")
		if env == "" {
			return nil
		}
		v, err := cli.ParseBytes(env)
		if err != nil {
			return fmt.Errorf("cuda: DISTILL_CUDA_MEMORY_CAP %v", err)
		}
		capBytes, what = v, "DISTILL_CUDA_MEMORY_CAP "+env
	}
	if capBytes < 0 {
		return fmt.Errorf("cuda: %s: want a positive size", what)
	}
	var f, t C.size_t
	if err := b.drv.check("cuMemGetInfo", C.call_cuMemGetInfo(b.drv.cuMemGetInfo, &f, &t)); err != nil {
		return err
	}
	gib := func(n int64) float64 { return float64(n) / (1 << 30) }
	hold := int64(t) - capBytes
	switch {
	case hold <= 0:
		return fmt.Errorf("cuda: %s is %.2f GiB, not less than %s's %.2f GiB: nothing to cap (unset it, or give a smaller size)",
			what, gib(capBytes), b.info.Name, gib(int64(t)))
	case hold > int64(f):
		return fmt.Errorf("cuda: %s: %s has %.2f GiB free of %.2f GiB, so this process cannot leave itself only %.2f GiB (something else holds %.2f GiB of it): give a smaller size, or free the device",
			what, b.info.Name, gib(int64(f)), gib(int64(t)), gib(capBytes), gib(int64(t)-int64(f)))
	}
	var p C.CUdeviceptr
	if err := b.drv.check(fmt.Sprintf("cuMemAlloc(%d bytes, the memory cap's hold)", hold), C.call_cuMemAlloc(b.drv.cuMemAlloc, &p, C.size_t(hold))); err != nil {
		return err
	}
	b.ballast, b.memCap = uint64(p), capBytes
	b.logf("cuda: %s: this process holds %.2f GiB of %s's %.2f GiB, leaving itself %.2f GiB as a smaller device would",
		what, gib(hold), b.info.Name, gib(int64(t)), gib(capBytes))
	b.info.TotalMem = capBytes
	return nil
}

// NoDeviceError is Open's error for a GPU ordinal the driver does not
// see: Count GPUs, ordinals 0 to Count-1.
type NoDeviceError struct{ Device, Count int }

func (e *NoDeviceError) Error() string {
	return fmt.Sprintf("cuda: device %d does not exist: the driver sees %d GPU(s), ordinals 0..%d", e.Device, e.Count, e.Count-1)
}

// startContext makes device's primary context current on the calling (locked)
// thread and creates what every call uses: the stream, the stream-ordered
// memory pool (which keeps freed memory), the cuBLASLt handle and its
// workspace.
func (b *Backend) startContext(device int) error {
	if err := b.drv.check("cuDeviceGet", C.call_cuDeviceGet(b.drv.cuDeviceGet, &b.dev, C.int(device))); err != nil {
		return err
	}
	if err := b.drv.check("cuDevicePrimaryCtxRetain", C.call_cuDevicePrimaryCtxRetain(b.drv.cuDevicePrimaryCtxRetain, &b.ctx, b.dev)); err != nil {
		return err
	}
	if err := b.drv.check("cuCtxSetCurrent", C.call_cuCtxSetCurrent(b.drv.cuCtxSetCurrent, b.ctx)); err != nil {
		return err
	}
	if err := b.drv.check("cuStreamCreate", C.call_cuStreamCreate(b.drv.cuStreamCreate, &b.stream, streamNonBlocking)); err != nil {
		return err
	}
	// Keep freed memory in the pool: Forward frees and reallocates the same
	// activation sizes every batch.
	if err := b.drv.check("cuDeviceGetDefaultMemPool", C.call_cuDeviceGetDefaultMemPool(b.drv.cuDeviceGetDefaultMemPool, &b.pool, b.dev)); err != nil {
		return err
	}
	thr := C.uint64_t(^uint64(0))
	if err := b.drv.check("cuMemPoolSetAttribute", C.call_cuMemPoolSetAttribute(b.drv.cuMemPoolSetAttribute, b.pool, mempoolAttrReleaseThreshold, unsafe.Pointer(&thr))); err != nil {
		return err
	}
	if err := b.lt.check("cublasLtCreate", C.call_cublasLtCreate(b.lt.create, &b.ltH)); err != nil {
		return err
	}
	if err := b.drv.check("cuMemAlloc(cuBLASLt workspace)", C.call_cuMemAlloc(b.drv.cuMemAlloc, (*C.CUdeviceptr)(&b.ws), gemmWorkspaceBytes)); err != nil {
		return err
	}
	return nil
}

// setOptions applies opt's choices (and their environment variables) to b,
// naming a value it does not know.
func (b *Backend) setOptions(opt Options) error {
	if opt.Profile {
		b.prof = map[string]*ProfileEntry{}
	}
	b.attn = attnMode(opt.Attention)
	if b.attn == "" {
		b.attn = attnMode(os.Getenv("DISTILL_CUDA_ATTN"))
	}
	switch b.attn {
	case "", "auto", "cudnn", "simt", "mma":
	default:
		return fmt.Errorf("cuda: attention %q: want auto, cudnn, mma or simt", b.attn)
	}
	b.attnBwd = attnMode(opt.AttentionBackward)
	if b.attnBwd == "" {
		b.attnBwd = attnMode(os.Getenv("DISTILL_CUDA_ATTN_BWD"))
	}
	if b.attnBwd != "" && b.attnBwd != "mma" {
		return fmt.Errorf("cuda: attention backward %q: want mma, or none to follow the attention's", b.attnBwd)
	}
	b.attnNondet = opt.AttnNondeterministic || os.Getenv("DISTILL_CUDNN_NONDETERMINISTIC") == "1"
	b.attnRagged = opt.AttnRaggedOnly || os.Getenv("DISTILL_CUDNN_RAGGED") == "1"
	b.f32Grads = opt.F32Grads || os.Getenv("DISTILL_CUDA_F32_GRADS") == "1"
	v1, err := altOption("MoE GEMM", opt.MoEGEMM, "DISTILL_CUDA_MOE_GEMM", "v1", "the default kernels")
	if err != nil {
		return err
	}
	if v1 {
		b.moeKernels = "v1"
	}
	if need := moeGEMMSmem("k_moe_gemm"); b.moeKernels == "" && b.info.SharedOptinBytes < need {
		// Ada (sm_89: 99 KB a block) cannot hold the default kernels' three
		// staged steps; the earlier kernels need 40 KB.
		b.moeKernels = "v1"
		b.logf("cuda: %s allows a block %d bytes of shared memory; the MoE experts' GEMMs need %d: running the earlier kernels (MoEGEMM v1)", b.info.Name, b.info.SharedOptinBytes, need)
	}
	fp8Scale := opt.FP8Scale
	if fp8Scale == "" {
		fp8Scale = os.Getenv("DISTILL_CUDA_FP8_SCALE")
	}
	switch fp8Scale {
	case "epilogue":
	case "", "outer":
		b.fp8OuterVec = b.lt.version >= ltOuterVecVersion
		if !b.fp8OuterVec && fp8Scale == "outer" {
			b.logf("cuda: FP8 scale outer: cuBLASLt %d has no outer-vector scales (12.9 and later have them); FP8 GEMMs scale their fp32 sums in a pass of their own", b.lt.version)
		}
	default:
		return fmt.Errorf("cuda: FP8 scale %q: want outer (the default: cuBLASLt's outer-vector scales, 12.9 and later) or epilogue (a scaling pass over fp32 sums)", fp8Scale)
	}
	b.fp8FastAccum = opt.FP8FastAccum || os.Getenv("DISTILL_CUDA_FP8_FAST_ACCUM") == "1"
	if b.rmsColsum, err = altOption("RMSNorm dw", opt.RMSNormDW, "DISTILL_CUDA_RMSNORM_DW", "colsum", "the fused kernels"); err != nil {
		return err
	}
	if b.lmFoldGEMM, err = altOption("LM-head fold", opt.LMFold, "DISTILL_CUDA_LM_FOLD", "gemm", "the default (k_lm_fold, a launch a piece)"); err != nil {
		return err
	}
	if b.sepResidual, err = altOption("residual add", opt.ResidualAdd, "DISTILL_CUDA_RESIDUAL_ADD", "separate", "the GEMM's epilogue"); err != nil {
		return err
	}
	b.pageable = opt.Pageable || os.Getenv("DISTILL_CUDA_PAGEABLE") == "1"
	b.noKeep = opt.RecomputeLogits || os.Getenv("DISTILL_CUDA_RECOMPUTE_LOGITS") == "1"
	b.eagerZeros = opt.EagerZeros || os.Getenv("DISTILL_CUDA_EAGER_ZEROS") == "1"
	act := opt.Activations
	if act == "" {
		act = os.Getenv("DISTILL_CUDA_ACT")
	}
	switch act {
	case "", "bf16":
		b.act = compute.BF16
	case "f32":
		b.act = compute.F32
	default:
		return fmt.Errorf("cuda: activations %q: want bf16 or f32", act)
	}
	b.shadow.off = opt.PerUseCasts || os.Getenv("DISTILL_CUDA_PER_USE_CASTS") == "1"
	return nil
}

// loadKernels compiles (or reads from the cache) every kernel file, the
// files in parallel with NVRTC 12 or newer (one at a time before: NVRTC
// 11's early releases were not documented thread-safe), and loads them
// and looks up their kernels in order on the calling thread (the
// context's).
func (b *Backend) loadKernels(kc *kernelCache) error {
	files := kernelFiles()
	par := 1
	if b.nv.major >= 12 {
		par = runtime.GOMAXPROCS(0)
	}
	t0 := time.Now()
	built := kc.cubins(b.nv, files, b.arch, par)
	compiled := 0
	for i, f := range files {
		r := built[i]
		if r.err != nil {
			return r.err
		}
		if r.cacheErr != nil {
			b.logf("cuda: %v (kernels will be recompiled next time)", r.cacheErr)
		}
		if !r.fromCache {
			compiled++
			b.logf("cuda: compiled %s for %s in %v", f, b.arch, r.took.Round(time.Millisecond))
		}
	}
	if compiled > 1 {
		b.logf("cuda: compiled %d kernel files for %s in %v, %d at a time (cached for the next start)", compiled, b.arch, time.Since(t0).Round(time.Millisecond), par)
	}
	for i, f := range files {
		cb := C.CBytes(built[i].cubin)
		var mod C.CUmodule
		err := b.drv.check("cuModuleLoadData("+string(f)+")", C.call_cuModuleLoadData(b.drv.cuModuleLoadData, &mod, cb))
		C.free(cb)
		if err != nil {
			return err
		}
		b.mods = append(b.mods, mod)
		for _, k := range f.kernels() {
			var fn C.CUfunction
			ck := C.CString(k)
			err := b.drv.check("cuModuleGetFunction("+k+")", C.call_cuModuleGetFunction(b.drv.cuModuleGetFunction, &fn, mod, ck))
			C.free(unsafe.Pointer(ck))
			if err != nil {
				return err
			}
			b.fns[k] = fn
		}
	}
	return nil
}

// Info describes the device.
func (b *Backend) Info() DeviceInfo { return b.info }

// Arch is the target the kernels were compiled for (sm_90a on Hopper).
func (b *Backend) Arch() string { return b.arch }

// Name implements compute.Backend.
func (*Backend) Name() string { return "cuda" }

// ActDType implements compute.Backend: BF16, unless Options.Activations
// (or $DISTILL_CUDA_ACT) is "f32".
func (b *Backend) ActDType() compute.DType { return b.act }

// Close releases the device memory of the backend itself (the weight
// shadows included; tensors are the caller's), its stream and its
// libraries' handles.
func (b *Backend) Close() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return nil
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if b.ctx != nil {
		C.call_cuCtxSetCurrent(b.drv.cuCtxSetCurrent, b.ctx)
	}
	b.release()
	b.closed = true
	return nil
}

// release frees what Open made, in reverse; it tolerates a partial Open.
func (b *Backend) release() {
	d := b.drv
	if b.stream != nil {
		// The weight shadows are the backend's own memory (the tensors
		// they shadow are the caller's).
		for _, r := range b.shadow.regs {
			if r.bf != 0 {
				C.call_cuMemFreeAsync(d.cuMemFreeAsync, C.CUdeviceptr(r.bf), b.stream)
			}
		}
		b.shadow.regs = nil
		C.call_cuStreamSynchronize(d.cuStreamSynchronize, b.stream)
		b.releaseStage()
	}
	for _, m := range b.marks {
		b.evFree = append(b.evFree, m.pre, m.end)
	}
	if b.side != nil {
		C.call_cuStreamSynchronize(d.cuStreamSynchronize, b.side)
	}
	for _, e := range append(b.evFree, b.evPlain...) {
		C.call_cuEventDestroy(d.cuEventDestroy, e)
	}
	b.marks, b.evFree, b.evPlain = nil, nil, nil
	for _, p := range b.plans {
		b.lt.destroyPlan(p)
	}
	b.plans = nil
	b.dnn.close()
	b.dnn = nil
	for _, m := range b.mods {
		C.call_cuModuleUnload(d.cuModuleUnload, m)
	}
	b.mods = nil
	if b.ws != 0 {
		C.call_cuMemFree(d.cuMemFree, C.CUdeviceptr(b.ws))
		b.ws = 0
	}
	if b.ballast != 0 {
		C.call_cuMemFree(d.cuMemFree, C.CUdeviceptr(b.ballast))
		b.ballast = 0
	}
	if b.ltH != nil {
		C.call_cublasLtDestroy(b.lt.destroy, b.ltH)
		b.ltH = nil
	}
	if b.stream != nil {
		C.call_cuStreamDestroy(d.cuStreamDestroy, b.stream)
		b.stream = nil
	}
	if b.side != nil {
		C.call_cuStreamDestroy(d.cuStreamDestroy, b.side)
		b.side = nil
	}
	b.releasePeer()
	if b.ctx != nil {
		C.call_cuDevicePrimaryCtxRelease(d.cuDevicePrimaryCtxRelease, b.dev)
		b.ctx = nil
	}
	if b.args != nil {
		C.free(b.args)
		b.args = nil
	}
}

// enter starts a call: the mutex, the OS thread, the context. The returned
// function ends it; when the call panics (out of memory part way through,
// a failed launch) with scratch of its own still allocated
// (callScratch), it frees that scratch first, so that a failed call
// leaves the device's memory as it found it, but for the tensors it made.
func (b *Backend) enter() func() {
	done := b.enterKeep()
	if len(b.zeros) > 0 { // deferred zeros (zeros.go): before this call's work
		ok := false
		defer func() {
			if !ok {
				done()
			}
		}()
		b.flushZeros()
		ok = true
	}
	return done
}

// enterKeep is enter for the calls that leave the deferred zeros pending
// (zeros.go): Zero, View, and the consumers, which take what they write
// and flush the rest themselves.
func (b *Backend) enterKeep() func() {
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		panic("cuda: backend used after Close")
	}
	runtime.LockOSThread()
	b.noteCall()
	b.callScratch = b.callScratch[:0]
	b.must(b.drv.check("cuCtxSetCurrent", C.call_cuCtxSetCurrent(b.drv.cuCtxSetCurrent, b.ctx)))
	return func() {
		if len(b.callScratch) > 0 { // only then is a panic recovered, and raised again
			if r := recover(); r != nil {
				for _, p := range b.callScratch {
					C.call_cuMemFreeAsync(b.drv.cuMemFreeAsync, C.CUdeviceptr(p), b.stream)
				}
				b.callScratch = b.callScratch[:0]
				runtime.UnlockOSThread()
				b.mu.Unlock()
				panic(r)
			}
		}
		runtime.UnlockOSThread()
		b.mu.Unlock()
	}
}

// must panics with err: the contract's kernels return no errors, and a
// failed CUDA call leaves nothing to continue with (serve recovers kernel
// panics into an error for the request).
func (b *Backend) must(err error) {
	if err != nil {
		panic(err)
	}
}

// sync waits for every issued kernel; errors of earlier asynchronous work
// surface here.
func (b *Backend) sync() {
	b.waited(WaitSync)
	t0 := time.Now()
	b.streamSync()
	b.noteWait(t0)
}

// streamSync is sync, not counted as a host wait of its own (download's).
func (b *Backend) streamSync() {
	b.must(b.drv.check("cuStreamSynchronize", C.call_cuStreamSynchronize(b.drv.cuStreamSynchronize, b.stream)))
	if !b.besideOn {
		b.stage.synced()
	}
}

// dptr is a device address, as a kernel argument.
type dptr uint64

// launchKernel enqueues kernel l.kernel with args, each a dptr, int32, int64,
// float32 or float64, matching the kernel's C++ parameters (i64 for int64,
// int for int32, double for float64, pointers for dptr).
func (b *Backend) launchKernel(l launch, args ...any) {
	fn, ok := b.fns[l.kernel]
	if !ok {
		panic(fmt.Sprintf("cuda: no kernel %s", l.kernel))
	}
	if len(args) > maxArgs {
		panic(fmt.Sprintf("cuda: %s: %d arguments, at most %d", l.kernel, len(args), maxArgs))
	}
	if l.grid[0] == 0 || l.grid[1] == 0 || l.grid[2] == 0 {
		return // nothing to do
	}
	slots := unsafe.Slice((*uint64)(b.args), maxArgs)
	ptrs := unsafe.Slice((*unsafe.Pointer)(unsafe.Add(b.args, maxArgs*8)), maxArgs)
	var sizes [maxArgs]C.int
	for i, a := range args {
		slots[i] = 0
		switch v := a.(type) {
		case dptr:
			slots[i], sizes[i] = uint64(v), 8
		case int64:
			slots[i], sizes[i] = uint64(v), 8
		case int32:
			*(*int32)(unsafe.Pointer(&slots[i])) = v
			sizes[i] = 4
		case float32:
			*(*float32)(unsafe.Pointer(&slots[i])) = v
			sizes[i] = 4
		case float64:
			*(*float64)(unsafe.Pointer(&slots[i])) = v
			sizes[i] = 8
		default:
			panic(fmt.Sprintf("cuda: %s argument %d has type %T; want dptr, int32, int64, float32 or float64", l.kernel, i, a))
		}
		ptrs[i] = unsafe.Pointer(&slots[i])
	}
	if b.checkParams != nil {
		if msg := C.call_distill_emu_check_params(b.checkParams, fn, &sizes[0], C.int(len(args))); msg != nil {
			panic(fmt.Sprintf("cuda: launching %s: %s", l.kernel, C.GoString(msg)))
		}
	}
	// Opt in to the dynamic shared memory whenever there is any: the 48 KB a
	// block gets by default counts static shared memory too.
	if l.smem > 0 && b.smem[l.kernel] < l.smem {
		if l.smem > b.info.SharedOptinBytes {
			panic(fmt.Sprintf("cuda: %s needs %d bytes of shared memory; %s allows a block %d", l.kernel, l.smem, b.info.Name, b.info.SharedOptinBytes))
		}
		b.must(b.drv.check("cuFuncSetAttribute("+l.kernel+")", C.call_cuFuncSetAttribute(b.drv.cuFuncSetAttribute, fn, funcAttrMaxDynamicShared, C.int(l.smem))))
		b.smem[l.kernel] = l.smem
	}
	defer b.timed(l.kernel)()
	if r := C.call_cuLaunchKernel(b.drv.cuLaunchKernel, fn,
		C.uint(l.grid[0]), C.uint(l.grid[1]), C.uint(l.grid[2]), C.uint(l.block), 1, 1, C.uint(l.smem), b.stream,
		(*unsafe.Pointer)(unsafe.Add(b.args, maxArgs*8))); r != 0 {
		b.must(b.drv.check("cuLaunchKernel("+l.kernel+")", r))
	}
}

// ProfileEntry is one kernel's (or one caller's GEMMs') total under
// Options.Profile.
type ProfileEntry struct {
	Name  string
	Calls int
	Time  time.Duration
	// Bytes is what the calls wrote, where the call says: a memset's and
	// a device-to-device copy's bytes, an NCCL collective's destination
	// on this rank; 0 for kernels. (The accounting of a step's passes
	// over its buffers: TestCUDAShardedStepPasses.)
	Bytes int64
}

// profMark is one timed call under Options.Profile: the events recorded
// on the stream before and after its work, and the bytes it wrote (0:
// not said).
type profMark struct {
	name     string
	pre, end C.CUevent
	bytes    int64
}

func nop() {}

// profStreamWait is the profile's entry for a stream's wait for an event
// of the other (the second stream's fences): counted, not timed.
const profStreamWait = "stream wait (event)"

// counted, under Options.Profile, counts one call of name that has no
// work of its own to time (Time stays 0).
func (b *Backend) counted(name string) {
	if b.prof == nil {
		return
	}
	e := b.prof[name]
	if e == nil {
		e = &ProfileEntry{Name: name}
		b.prof[name] = e
	}
	e.Calls++
}

// timed, under Options.Profile, records an event on the stream before
// what name issues and returns a function that records one after it: the
// GPU's own clock times the call, and nothing waits (a host timer around
// a synchronization per call added each launch's latency to every small
// kernel and kept the GPU idle between them). Profile reads the events.
func (b *Backend) timed(name string) func() { return b.timedBytes(name, 0) }

// timedBytes is timed for a call that writes n bytes (ProfileEntry.Bytes).
func (b *Backend) timedBytes(name string, n int64) func() {
	if b.prof == nil {
		return nop
	}
	if b.tl.FirstLaunch.IsZero() {
		b.tl.FirstLaunch = time.Now()
	}
	pre := b.event()
	return func() {
		b.marks = append(b.marks, profMark{name: name, pre: pre, end: b.event(), bytes: n})
	}
}

// event returns an event (a recycled one, else a new one) recorded on the
// stream now.
func (b *Backend) event() C.CUevent {
	var e C.CUevent
	if n := len(b.evFree); n > 0 {
		e, b.evFree = b.evFree[n-1], b.evFree[:n-1]
	} else {
		b.must(b.drv.check("cuEventCreate", C.call_cuEventCreate(b.drv.cuEventCreate, &e, 0)))
	}
	b.must(b.drv.check("cuEventRecord", C.call_cuEventRecord(b.drv.cuEventRecord, e, b.stream)))
	return e
}

// readMarks waits for the stream, adds each mark's time to b.prof and
// returns its events for reuse; it keeps the span from the first mark's
// start to the last one's end (ProfileSpan).
func (b *Backend) readMarks() {
	if len(b.marks) == 0 {
		return
	}
	b.sync()
	elapsed := func(a, z C.CUevent) time.Duration {
		var ms C.float
		b.must(b.drv.check("cuEventElapsedTime", C.call_cuEventElapsedTime(b.drv.cuEventElapsedTime, &ms, a, z)))
		return time.Duration(float64(ms) * float64(time.Millisecond))
	}
	b.span = elapsed(b.marks[0].pre, b.marks[len(b.marks)-1].end)
	for _, m := range b.marks {
		if b.prof != nil {
			e := b.prof[m.name]
			if e == nil {
				e = &ProfileEntry{Name: m.name}
				b.prof[m.name] = e
			}
			e.Calls++
			e.Time += elapsed(m.pre, m.end)
			e.Bytes += m.bytes
		}
		b.evFree = append(b.evFree, m.pre, m.end)
	}
	b.marks = b.marks[:0]
}

// ProfileSpan is the GPU time from the start of the first call the last
// Profile read to the end of the last one: beside the calls' sum, what the
// GPU spent waiting between them (for the host to issue work, or for a
// synchronization's round trip).
func (b *Backend) ProfileSpan() time.Duration {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.span
}

// Profile returns the time spent per kernel (GEMMs per calling method),
// the largest first, and resets the counters. Empty unless
// Options.Profile.
func (b *Backend) Profile() []ProfileEntry {
	defer b.enter()()
	b.readMarks()
	var out []ProfileEntry
	for _, e := range b.prof {
		out = append(out, *e)
	}
	clear(b.prof)
	sort.Slice(out, func(i, j int) bool { return out[i].Time > out[j].Time })
	return out
}

// MemInfo implements compute.DeviceMemory: the device's total memory, and
// what this backend can still allocate: the driver's free memory plus what
// the stream-ordered pool holds for reuse (it keeps what was freed: the
// driver counts that as used).
func (b *Backend) MemInfo() (free, total int64) {
	defer b.enter()()
	b.sync()
	var f, t C.size_t
	b.must(b.drv.check("cuMemGetInfo", C.call_cuMemGetInfo(b.drv.cuMemGetInfo, &f, &t)))
	reserved, used := b.poolAttr(mempoolAttrReservedMemCur), b.poolAttr(mempoolAttrUsedMemCur)
	if b.memCap > 0 { // the hold is out of f already
		return int64(f) + max(0, reserved-used), b.memCap
	}
	return int64(f) + max(0, reserved-used), int64(t)
}

// poolAttr reads one of the pool's byte counts.
func (b *Backend) poolAttr(attr C.int) int64 {
	var v C.uint64_t
	b.must(b.drv.check("cuMemPoolGetAttribute", C.call_cuMemPoolGetAttribute(b.drv.cuMemPoolGetAttribute, b.pool, attr, unsafe.Pointer(&v))))
	return int64(v)
}

// PeakMemory returns the most device memory this process's tensors and
// scratch have held at once since the backend opened or since the last
// ResetPeakMemory: the stream-ordered pool's USED_MEM_HIGH (bytes in use,
// not what the pool keeps for reuse; cuBLASLt's workspace, allocated
// outside the pool, is not counted). It synchronizes, so that the work
// issued so far is in it.
func (b *Backend) PeakMemory() int64 {
	defer b.enter()()
	b.sync()
	return b.poolAttr(mempoolAttrUsedMemHigh)
}

// ResetPeakMemory restarts PeakMemory's high-water mark from the memory
// in use now, after the work issued so far.
func (b *Backend) ResetPeakMemory() {
	defer b.enter()()
	b.sync()
	var v C.uint64_t
	b.must(b.drv.check("cuMemPoolSetAttribute(USED_MEM_HIGH)", C.call_cuMemPoolSetAttribute(b.drv.cuMemPoolSetAttribute, b.pool, mempoolAttrUsedMemHigh, unsafe.Pointer(&v))))
}

// --- Memory.

// tensor is the CUDA Tensor: device memory of n elements.
type tensor struct {
	b      *Backend
	dt     compute.DType
	n      int
	p      uint64
	weight bool // made by Weight: immutable, so derived copies may be cached
	view   bool // shares another tensor's memory; Free is a no-op
	freed  bool
}

func (t *tensor) DType() compute.DType { return t.dt }
func (t *tensor) Len() int             { return t.n }

func elemSize(dt compute.DType) int {
	switch dt {
	case compute.BF16:
		return 2
	case compute.F8E4M3:
		return 1 // the codes (fp8.go: the scales follow them)
	}
	return 4
}

func (t *tensor) bytes() int64 { return int64(t.n) * int64(elemSize(t.dt)) }

// ten unwraps a Tensor of this backend; anything else is a caller's bug.
func (b *Backend) ten(x compute.Tensor, what string) *tensor {
	t, ok := x.(*tensor)
	if !ok || t == nil {
		panic(fmt.Sprintf("cuda: %s is a tensor of another backend (%T)", what, x))
	}
	if t.b != b {
		panic(fmt.Sprintf("cuda: %s belongs to another CUDA backend", what))
	}
	if t.freed {
		panic(fmt.Sprintf("cuda: %s was freed", what))
	}
	return t
}

// need checks that t holds at least n elements, of one of the types dts.
func need(t *tensor, what string, n int, dts ...compute.DType) {
	okType := false
	for _, dt := range dts {
		okType = okType || t.dt == dt
	}
	if !okType {
		panic(fmt.Sprintf("cuda: %s is %v, want %v", what, t.dt, dts))
	}
	if t.n < n {
		panic(fmt.Sprintf("cuda: %s has %d elements, the call needs %d", what, t.n, n))
	}
}

// alloc returns n bytes of device memory from the stream-ordered pool:
// the call's scratch (callScratch) until it is freed, or kept (keep).
func (b *Backend) alloc(n int64) uint64 {
	if n <= 0 {
		return 0
	}
	var p C.CUdeviceptr
	// The call's name is formatted only on failure: alloc runs thousands
	// of times a training step.
	if r := C.call_cuMemAllocAsync(b.drv.cuMemAllocAsync, &p, C.size_t(n), b.stream); r != 0 {
		b.must(b.drv.check(fmt.Sprintf("cuMemAllocAsync(%d bytes)", n), r))
	}
	b.callScratch = append(b.callScratch, uint64(p))
	return uint64(p)
}

// devScratch is device memory a multi-stage call hands out and frees
// together (release; MoE's stages, its operands, its adapters).
type devScratch struct {
	b   *Backend
	ptr []uint64
}

// scratch returns n bytes of device memory freed by release.
func (s *devScratch) scratch(n int64) uint64 {
	p := s.b.alloc(n)
	s.ptr = append(s.ptr, p)
	return p
}

// own makes release free p too.
func (s *devScratch) own(p uint64) { s.ptr = append(s.ptr, p) }

// release frees what scratch returned and own took.
func (s *devScratch) release() {
	for _, p := range s.ptr {
		s.b.free(p)
	}
	s.ptr = nil
}

// keep says that p, just allocated, outlives the call: a tensor's memory,
// a cached copy. A call's other allocations are scratch, freed if the
// call panics (enter).
func (b *Backend) keep(p uint64) { b.dropScratch(p) }

// dropScratch removes p from the call's scratch, if it is there (the
// latest first: scratch is freed in about the reverse order).
func (b *Backend) dropScratch(p uint64) {
	for i := len(b.callScratch) - 1; i >= 0; i-- {
		if b.callScratch[i] == p {
			b.callScratch = append(b.callScratch[:i], b.callScratch[i+1:]...)
			return
		}
	}
}

// free returns device memory to the pool once the stream's work so far
// is done.
func (b *Backend) free(p uint64) {
	if p != 0 {
		b.dropScratch(p)
		b.must(b.drv.check("cuMemFreeAsync", C.call_cuMemFreeAsync(b.drv.cuMemFreeAsync, C.CUdeviceptr(p), b.stream)))
	}
}

func (b *Backend) newTensor(dt compute.DType, n int) *tensor {
	if n < 0 {
		panic(fmt.Sprintf("cuda: tensor of %d elements", n))
	}
	t := &tensor{b: b, dt: dt, n: n}
	t.p = b.alloc(t.bytes())
	b.keep(t.p)
	return t
}

func (b *Backend) memset0(p uint64, n int64) {
	if n > 0 {
		defer b.timedBytes("memset", n)()
		b.must(b.drv.check("cuMemsetD8Async", C.call_cuMemsetD8Async(b.drv.cuMemsetD8Async, C.CUdeviceptr(p), 0, C.size_t(n), b.stream)))
	}
}

// upload copies n bytes at src to device address p. The source may be
// reused when it returns. Up to stageMax bytes go through the pinned
// staging ring (staging.go) and never wait; larger ones (weights) are
// copied from the pageable source, which the driver stages itself and
// may wait for the stream to do so (a host wait: hostwait.go).
func (b *Backend) upload(p uint64, src unsafe.Pointer, n int64) {
	if n <= 0 {
		return
	}
	if !b.pageable {
		if h := b.stageUpload(src, n); h != nil {
			b.uploadPinned(p, h, n)
			return
		}
	}
	b.waited(WaitUpload)
	t0 := time.Now()
	b.uploadPinned(p, src, n)
	b.noteWait(t0)
}

// uploadPinned is upload from pinned host memory (cuMemAllocHost): it
// never waits, and the caller keeps src unchanged until the copy is done
// (an event after it).
func (b *Backend) uploadPinned(p uint64, src unsafe.Pointer, n int64) {
	if n > 0 {
		b.must(b.drv.check("cuMemcpyHtoDAsync", C.call_cuMemcpyHtoDAsync(b.drv.cuMemcpyHtoDAsync, C.CUdeviceptr(p), src, C.size_t(n), b.stream)))
	}
}

// copyD copies n bytes on the device, in stream order.
func (b *Backend) copyD(dst, src uint64, n int64) {
	defer b.timedBytes("memcpy DtoD", n)()
	b.must(b.drv.check("cuMemcpyDtoDAsync", C.call_cuMemcpyDtoDAsync(b.drv.cuMemcpyDtoDAsync, C.CUdeviceptr(dst), C.CUdeviceptr(src), C.size_t(n), b.stream)))
}

// download copies n bytes from p to dst after all issued work, and waits.
func (b *Backend) download(dst unsafe.Pointer, p uint64, n int64) {
	if n > 0 {
		b.must(b.drv.check("cuMemcpyDtoHAsync", C.call_cuMemcpyDtoHAsync(b.drv.cuMemcpyDtoHAsync, dst, C.CUdeviceptr(p), C.size_t(n), b.stream)))
	}
	b.waited(WaitDownload)
	t0 := time.Now()
	b.streamSync()
	b.noteWait(t0)
}

// New implements compute.Backend: a zeroed tensor.
func (b *Backend) New(dt compute.DType, n int) compute.Tensor {
	defer b.enter()()
	t := b.newTensor(dt, n)
	b.memset0(t.p, t.bytes())
	return t
}

// FromF32 implements compute.Backend.
func (b *Backend) FromF32(src []float32) compute.Tensor {
	defer b.enter()()
	t := b.newTensor(compute.F32, len(src))
	if len(src) > 0 {
		b.upload(t.p, unsafe.Pointer(&src[0]), t.bytes())
	}
	return t
}

// FromI32 implements compute.Backend.
func (b *Backend) FromI32(src []int32) compute.Tensor {
	defer b.enter()()
	t := b.newTensor(compute.I32, len(src))
	if len(src) > 0 {
		b.upload(t.p, unsafe.Pointer(&src[0]), t.bytes())
	}
	return t
}

// Weight implements compute.Backend: BF16 stays BF16 on the device (the
// GEMMs' operand type); F32 stays F32 (norm weights keep their digits) and
// gets a BF16 copy the first time a GEMM needs one.
func (b *Backend) Weight(src any) (compute.Tensor, error) {
	defer b.enter()()
	var t *tensor
	switch s := src.(type) {
	case []uint16:
		t = b.newTensor(compute.BF16, len(s))
		if len(s) > 0 {
			b.upload(t.p, unsafe.Pointer(&s[0]), t.bytes())
		}
	case []float32:
		t = b.newTensor(compute.F32, len(s))
		if len(s) > 0 {
			b.upload(t.p, unsafe.Pointer(&s[0]), t.bytes())
		}
	default:
		return nil, fmt.Errorf("cuda: weight of type %T; want []float32 or []uint16 (bf16)", src)
	}
	t.weight = true
	return t, nil
}

// ReadF32 implements compute.Backend: min(len(dst), t.Len()) elements of an
// F32 tensor, or of a BF16 one widened.
func (b *Backend) ReadF32(x compute.Tensor, dst []float32) {
	defer b.enter()()
	t := b.ten(x, "ReadF32 source")
	n := min(len(dst), t.n)
	switch t.dt {
	case compute.F32:
		if n == 0 {
			b.sync()
			return
		}
		b.download(unsafe.Pointer(&dst[0]), t.p, int64(n)*4)
	case compute.BF16:
		h := make([]uint16, n)
		if n == 0 {
			b.sync()
			return
		}
		b.download(unsafe.Pointer(&h[0]), t.p, int64(n)*2)
		compute.WidenBF16(dst, h)
	default:
		panic(fmt.Sprintf("cuda: ReadF32 of an %v tensor", t.dt))
	}
}

// ReadI32 implements compute.Backend.
func (b *Backend) ReadI32(x compute.Tensor, dst []int32) {
	defer b.enter()()
	t := b.ten(x, "ReadI32 source")
	if t.dt != compute.I32 {
		panic(fmt.Sprintf("cuda: ReadI32 of an %v tensor", t.dt))
	}
	n := min(len(dst), t.n)
	if n == 0 {
		b.sync()
		return
	}
	b.download(unsafe.Pointer(&dst[0]), t.p, int64(n)*4)
}

// Free implements compute.Backend. Freeing twice is a no-op; using a freed
// tensor panics.
func (b *Backend) Free(x compute.Tensor) {
	defer b.enter()()
	t, ok := x.(*tensor)
	if !ok || t == nil || t.freed || t.b != b {
		return
	}
	t.freed = true
	if t.view {
		return
	}
	for _, m := range []map[*tensor]*tensor{b.bf16Of, b.f32Of} {
		if c, ok := m[t]; ok {
			b.free(c.p)
			delete(m, t)
		}
	}
	b.dropRange(t.p, t.bytes())
	b.free(t.p)
	t.p = 0
}

// View returns elements [off, off+n) of t sharing its memory; freeing a
// view is a no-op, and it is valid while t is.
func (b *Backend) View(x compute.Tensor, off, n int) compute.Tensor {
	defer b.enterKeep()()
	t := b.ten(x, "View source")
	if off < 0 || n < 0 || off+n > t.n {
		panic(fmt.Sprintf("cuda: View [%d, %d) of a tensor of %d elements", off, off+n, t.n))
	}
	return &tensor{b: b, dt: t.dt, n: n, p: t.p + uint64(off*elemSize(t.dt)), view: true}
}

// Zero sets every element of t to 0: at the next call, which may write t
// instead of adding to it (zeros.go).
func (b *Backend) Zero(x compute.Tensor) {
	defer b.enterKeep()()
	b.wroteT(x)
	t := b.ten(x, "Zero target")
	b.deferZero(t.p, t.bytes())
}

// Copy: dst[0:src.Len()) = src, same dtype, not overlapping.
func (b *Backend) Copy(dstT, srcT compute.Tensor) {
	defer b.enter()()
	b.wroteT(dstT)
	dst, src := b.ten(dstT, "Copy destination"), b.ten(srcT, "Copy source")
	if dst.dt != src.dt || dst.n < src.n {
		panic(fmt.Sprintf("cuda: Copy of %d %v elements into %d %v", src.n, src.dt, dst.n, dst.dt))
	}
	if src.n > 0 {
		b.copyD(dst.p, src.p, int64(src.bytes()))
	}
}

// WriteF32 copies host data into t[0:len(src)): t is F32, or a BF16
// activation (rounded to nearest even on the host).
func (b *Backend) WriteF32(x compute.Tensor, src []float32) {
	defer b.enter()()
	b.wroteT(x)
	t := b.ten(x, "WriteF32 target")
	need(t, "WriteF32 target", len(src), act...)
	switch {
	case len(src) == 0:
	case t.dt == compute.BF16:
		h := make([]uint16, len(src))
		compute.NarrowBF16(h, src)
		b.upload(t.p, unsafe.Pointer(&h[0]), int64(len(h))*2)
	default:
		b.upload(t.p, unsafe.Pointer(&src[0]), int64(len(src))*4)
	}
}

// unsafePtr is the address of a non-empty slice's first element.
func unsafePtr[T any](s []T) unsafe.Pointer { return unsafe.Pointer(&s[0]) }

// Probe reports whether a CUDA GPU is usable without compiling anything:
// the driver loads and sees a device of compute capability 8.0 or newer.
// A device chooser (--device auto) calls it to decide, and logs the error
// when it falls back to the CPU.
func Probe() (DeviceInfo, error) {
	drv, err := loadDriver()
	if err != nil {
		return DeviceInfo{}, err
	}
	defer drv.lib.close()
	if err := drv.check("cuInit", C.call_cuInit(drv.cuInit, 0)); err != nil {
		return DeviceInfo{}, err
	}
	var count C.int
	if err := drv.check("cuDeviceGetCount", C.call_cuDeviceGetCount(drv.cuDeviceGetCount, &count)); err != nil {
		return DeviceInfo{}, err
	}
	if count == 0 {
		return DeviceInfo{}, fmt.Errorf("cuda: the driver (%s) sees no GPU", drv.lib.path)
	}
	info, err := drv.deviceInfo(0)
	if err == nil && info.Major < 8 {
		err = fmt.Errorf("cuda: %s has compute capability %d.%d; this backend needs 8.0 (Ampere) or newer", info.Name, info.Major, info.Minor)
	}
	return info, err
}

// DeviceCount is the number of GPUs the driver sees (--devices all).
func DeviceCount() (int, error) {
	drv, err := loadDriver()
	if err != nil {
		return 0, err
	}
	defer drv.lib.close()
	if err := drv.check("cuInit", C.call_cuInit(drv.cuInit, 0)); err != nil {
		return 0, err
	}
	var count C.int
	if err := drv.check("cuDeviceGetCount", C.call_cuDeviceGetCount(drv.cuDeviceGetCount, &count)); err != nil {
		return 0, err
	}
	return int(count), nil
}

// SetProfile switches kernel timing (Options.Profile) on or off, clearing
// the counters: a benchmark times its steps unprofiled, then profiles one.
func (b *Backend) SetProfile(on bool) {
	defer b.enter()()
	b.readMarks() // recycles the events of calls no Profile read
	b.prof = nil
	b.tl = HostTimeline{}
	if on {
		b.prof = map[string]*ProfileEntry{}
	}
}
