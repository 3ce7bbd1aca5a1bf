package main

import (
	"math"
	"strings"
	"testing"

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
