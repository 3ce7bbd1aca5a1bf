package examples

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestGPUSuiteDryRun runs the GPU commands of docs/gpu.md as a session with a
// device would, on the CPU emulator of CUDA (DISTILL_GPU_SUITE_EMU=1):
// `scripts/gpu-suite.sh build`, then the one-call script
// scripts/gpu/attn-call.sh with its BF16/fp32 comparison (ACT_COMPARE=1)
// over the steps env, nccl, moe and train-bench, from the bundle alone. A
// broken script costs a device session its scarce minutes; here it costs
// a failing test.
func TestGPUSuiteDryRun(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: builds the GPU test bundle")
	}
	if out, err := repoScript(nil, "scripts/gpu-suite.sh", "build"); err != nil {
		t.Fatalf("gpu-suite.sh build: %v\n%s", err, out)
	}
	out := t.TempDir()
	log, err := repoScript([]string{"DISTILL_GPU_SUITE_EMU=1", "ACT_COMPARE=1", "SKIP_SYSTEM_CUDNN=1", "OUT=" + out,
		"DISTILL_GPU_BIN=" + filepath.Join(t.TempDir(), "bin"), "DISTILL_KERNEL_CACHE=" + t.TempDir()},
		"scripts/gpu/attn-call.sh", "env", "nccl", "moe", "train-bench")
	if err != nil {
		t.Fatalf("attn-call.sh: %v\n%s", err, log)
	}
	for _, want := range []string{"env 0", "nccl 0", "moe-test 0", "moe-bench 0", "BenchmarkMoE/forward/v1", "train-bench 0", "== fp32 activations (DISTILL_CUDA_ACT=f32), same device", "BenchmarkCUDATrainStep"} {
		if !strings.Contains(string(log), want) {
			t.Errorf("attn-call.sh's summary lacks %q:\n%s", want, log)
		}
	}
	if st, err := os.Stat(filepath.Join(out, "logs.tgz")); err != nil || st.Size() == 0 {
		t.Errorf("no logs.tgz under OUT: %v", err)
	}
}
