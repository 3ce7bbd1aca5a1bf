package cuda

import (
	"os/exec"
	"path/filepath"
	"testing"

	"distill/compute/cuda/cudaemu"
)

// TestEmuCUDNN checks the emulator's stand-in for cuDNN's graph API
// (testdata/emu/emu_cudnn.cpp) through its C entry points: it builds
// testdata/emu/cudnncheck, a C++ caller, against the emulator library and
// runs it. The program builds graphs as a caller of libcudnn does and
// compares their results with double-precision references: a matmul with
// grouped (GQA) heads and a transposed operand; ragged tensors under GEMM
// M overrides, written only where the overrides allow and refused where
// they would cross into the next sample; exact data type conversions
// (bf16 round-to-nearest-even); the fused-attention forward and backward
// graphs (causal; with the padding mask on a dense layout; ragged with
// GQA and a sample without keys), in shuffled node order; and the
// refusals at finalize and execute (malformed tensors, shapes, duplicate
// uids, unproduced operands, cycles, pointers outside their allocation,
// the variant pack, the workspace, alignment, DISTILL_EMU_CUDNN_REFUSE and
// DISTILL_EMU_CUDNN_VERSION).
func TestEmuCUDNN(t *testing.T) {
	if onGPU() {
		t.Skip("an emulator test")
	}
	useEmu(t) // skips (or fails under DISTILL_REQUIRE_NVRTC=1) without an emulator
	lib, err := cudaemu.Library()
	if err != nil {
		t.Fatal(err)
	}
	cxx, err := exec.LookPath("g++")
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(t.TempDir(), "cudnn_check")
	src := filepath.Join("testdata", "emu", "cudnncheck", "cudnn_check.cpp")
	if out, err := exec.Command(cxx, "-std=c++17", "-O1", "-Wall", "-o", bin, src, lib, "-Wl,-rpath,"+filepath.Dir(lib)).CombinedOutput(); err != nil {
		t.Fatalf("building %s: %v\n%s", src, err, out)
	}
	out, err := exec.Command(bin).CombinedOutput()
	if err != nil {
		t.Fatalf("%s: %v\n%s", src, err, out)
	}
	t.Logf("%s", out)
}
