package trainer

import (
	"bytes"
	"strings"
	"testing"

	"distill/compute/cuda/cudaemu"
)

// TestTrainingDeviceAutoIsCPU: with a GPU present (the CPU emulator of
// CUDA), train.device auto still builds the student on the CPU, since the
// CUDA backend has no training kernels yet, and the run's log says why;
// train.device cuda is refused by the config's validation, before
// anything runs.
func TestTrainingDeviceAutoIsCPU(t *testing.T) {
	cudaemu.Use(t)
	t.Setenv("DISTILL_KERNEL_CACHE", t.TempDir())
	b := testCache(t)
	cfg := tinyConfig(t, b, t.TempDir())
	cfg.Train.Device = "auto"
	var log bytes.Buffer
	s, err := initStudent(cfg, &log)
	if err != nil {
		t.Fatal(err)
	}
	if got := s.Backend().Name(); got != "cpu" {
		t.Errorf("train.device auto with a GPU: the student runs on %s, want cpu", got)
	}
	if !strings.Contains(log.String(), "cannot train yet (issue 16): training on the CPU") {
		t.Errorf("log %q does not say why training runs on the CPU", log.String())
	}
	cfg.Train.Device = "cuda"
	if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), "issue 16") {
		t.Errorf("train.device cuda: Validate = %v, want the refusal", err)
	}
}
