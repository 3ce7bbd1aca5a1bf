package main

import (
	"math"
	"path/filepath"
	"strings"
	"testing"

	"distill/compute/cuda/cudaemu"
	"distill/model"
)

// TestScoreRefusesNonFiniteWeights: a checkpoint with a NaN weight is an
// error naming the tensor, not a table of NaN probabilities and exit 0.
func TestScoreRefusesNonFiniteWeights(t *testing.T) {
	dir := t.TempDir()
	cfg, err := model.Preset(model.ArchQwen3)
	if err != nil {
		t.Fatal(err)
	}
	cfg.VocabSize, cfg.Hidden, cfg.Layers, cfg.Intermediate, cfg.MaxPositions = 64, 32, 1, 64, 64
	w := model.Init(cfg, model.InitOptions{Seed: 1})
	const bad = "model.layers.0.mlp.down_proj.weight"
	w[bad][5] = float32(math.NaN())
	if err := model.WriteCheckpoint(dir, cfg, w, "BF16"); err != nil {
		t.Fatal(err)
	}
	err = runScore([]string{"--model", dir, "--ids", "1,2,3", "--k", "2"})
	if err == nil || !strings.Contains(err.Error(), bad) || !strings.Contains(err.Error(), "non-finite") {
		t.Fatalf("score with a NaN weight: %v", err)
	}
}

// TestScoreDevice: --device cuda scores on the CUDA backend (the CPU
// emulator of CUDA here) and, where there is no driver, fails naming the
// missing library; a bad name is refused.
func TestScoreDevice(t *testing.T) {
	dir := t.TempDir()
	cfg, err := model.Preset(model.ArchQwen3)
	if err != nil {
		t.Fatal(err)
	}
	cfg.VocabSize, cfg.Hidden, cfg.Layers, cfg.Intermediate, cfg.MaxPositions = 64, 32, 1, 64, 64
	if err := model.WriteCheckpoint(dir, cfg, model.Init(cfg, model.InitOptions{Seed: 1}), "BF16"); err != nil {
		t.Fatal(err)
	}
	args := []string{"--model", dir, "--ids", "1,2,3", "--k", "2", "--device"}
	if err := runScore(append(args, "tpu")); err == nil || !strings.Contains(err.Error(), "want auto, cpu or cuda") {
		t.Errorf("--device tpu: %v", err)
	}
	t.Run("no driver", func(t *testing.T) {
		t.Setenv("DISTILL_LIBCUDA", filepath.Join(t.TempDir(), "libcuda.so.1"))
		if err := runScore(append(args, "cuda")); err == nil || !strings.Contains(err.Error(), "DISTILL_LIBCUDA") {
			t.Errorf("--device cuda without a driver: %v", err)
		}
		if err := runScore(append(args, "auto")); err != nil {
			t.Errorf("--device auto without a driver (the CPU): %v", err)
		}
	})
	t.Run("emulated GPU", func(t *testing.T) {
		cudaemu.Use(t)
		t.Setenv("DISTILL_KERNEL_CACHE", t.TempDir())
		if err := runScore(append(args, "cuda")); err != nil {
			t.Errorf("--device cuda on the emulated GPU: %v", err)
		}
	})
}
