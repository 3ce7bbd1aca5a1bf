package model

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestLoadConfigRunDir: a student train run directory given where an HF
// checkpoint goes (teacherd --model, cachectl fill --model) says what it
// is and what to give instead; it said only that config.json was missing.
func TestLoadConfigRunDir(t *testing.T) {
	run := t.TempDir()
	os.MkdirAll(filepath.Join(run, "checkpoints", "step-00000002"), 0o755)
	os.WriteFile(filepath.Join(run, "config.yaml"), []byte("run_dir: x\n"), 0o644)
	_, err := LoadConfig(run)
	want := "(" + run + " is a student train run directory, not an HF checkpoint: export it with student export --checkpoint " + run +
		" --out DIR --format bf16, and give DIR)"
	if err == nil || !strings.HasSuffix(err.Error(), want) {
		t.Errorf("a run directory: %v\nwant it to end %s", err, want)
	}
	// Any other directory without config.json: as before.
	_, err = LoadConfig(t.TempDir())
	if err == nil || !strings.HasSuffix(err.Error(), "(a checkpoint directory needs config.json)") {
		t.Errorf("a directory without config.json: %v", err)
	}
	// A directory that does not exist, and a file given for its
	// directory: said so, not config.json's open error.
	missing := filepath.Join(t.TempDir(), "nomodel")
	if _, err := LoadConfig(missing); err == nil || err.Error() != "checkpoint directory "+missing+" does not exist (give the HF checkpoint's directory: the one holding config.json and model.safetensors)" {
		t.Errorf("a missing directory: %v", err)
	}
	file := filepath.Join(t.TempDir(), "model.safetensors")
	os.WriteFile(file, nil, 0o644)
	if _, err := LoadConfig(file); err == nil || !strings.Contains(err.Error(), file+" is a file, not a checkpoint directory (give the directory that holds config.json and model.safetensors: "+filepath.Dir(file)+")") {
		t.Errorf("a file: %v", err)
	}
}
