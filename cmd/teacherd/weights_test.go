package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestWeightsFlag: weights: in the config file and --weights reach the
// daemon's config (the flag overriding the file), an FP8 teacher serves,
// and an unknown format is refused before the daemon listens.
func TestWeightsFlag(t *testing.T) {
	p := filepath.Join(t.TempDir(), "t.yaml")
	os.WriteFile(p, []byte("model: /m\nweights: fp8\n"), 0o644)
	cfg, _, _, err := parseConfig([]string{"--config", p})
	if err != nil || cfg.Weights != "fp8" {
		t.Fatalf("weights: fp8 in the file: %q, %v", cfg.Weights, err)
	}
	cfg, _, _, err = parseConfig([]string{"--config", p, "--weights", "bf16"})
	if err != nil || cfg.Weights != "bf16" {
		t.Fatalf("--weights bf16 over the file: %q, %v", cfg.Weights, err)
	}
	err = run([]string{"--model", tinyModelDir(t), "--weights", "int4", "--listen", "127.0.0.1:0", "--metrics", "off", "--device", "cpu"})
	if err == nil || !strings.Contains(err.Error(), `--weights "int4": want bf16 or fp8`) {
		t.Errorf("--weights int4: %v", err)
	}
}
