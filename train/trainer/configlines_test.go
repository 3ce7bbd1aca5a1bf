package trainer

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestConfigErrorLines: an error in the file names the line of the file
// as written (comments and blank lines included, which a re-encoded tree
// drops), and an error an override brings names its --set flag, not a
// line of the file; an invalid value names the flags beside the file, and
// optim's errors say "optim" once.
func TestConfigErrorLines(t *testing.T) {
	p := filepath.Join(t.TempDir(), "c.yaml")
	text := "# a config\n\nrun_dir: x   # where it goes\n\n# the model\nmodel:\n  init_from: y\n\n\ndata:\n  # the cache\n  cache: [z]\n\n  seq_lenn: 5\n"
	os.WriteFile(p, []byte(text), 0o644)
	if _, err := LoadConfig(p, nil); !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "line 14: field seq_lenn") {
		t.Errorf("unknown key on line 14: %v", err)
	}
	os.WriteFile(p, []byte(strings.Replace(text, "seq_lenn: 5", "seq_len: 5", 1)+"\n# optimizer\n\noptim:\n  lr: 0.1\n  beta1: 0.9\n"), 0o644)
	if _, err := LoadConfig(p, nil); err != nil {
		t.Fatal(err)
	}
	for over, want := range map[string]string{
		"optim.lrr=1e-3":      "--set optim.lrr=1e-3: yaml: unmarshal errors:\n  field lrr not found in type trainer.OptimConfig",
		"optim.beta1=abc":     "--set optim.beta1=abc: yaml: unmarshal errors:\n  cannot unmarshal !!str `abc` into float64",
		"train.max_steps=1.5": `--set train.max_steps=1.5: train.max_steps: "1.5" is not an integer`,
		"optim.lr=-1":         "c.yaml with --set train.max_steps=3 --set optim.lr=-1: trainer: bad config: optim: invalid configuration: lr -1",
	} {
		_, err := LoadConfig(p, []string{"train.max_steps=3", over})
		if !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), want) || strings.Contains(err.Error(), "line ") {
			t.Errorf("--set %s: %v\nwant %q and no line", over, err, want)
		}
		if err != nil && strings.Contains(err.Error(), "optim: optim") {
			t.Errorf("--set %s: %v repeats its prefix", over, err)
		}
	}
}
