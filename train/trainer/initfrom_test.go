package trainer

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestCheckInitFrom: a model.init_from that is a student train run
// directory, or a LoRA run's checkpoint (adapters only), is refused
// naming what to give instead (they failed on a missing config.json, or
// listed every base tensor as missing); an HF checkpoint, a full
// student's checkpoint and a path this check does not know pass (the
// loader reports those).
func TestCheckInitFrom(t *testing.T) {
	dir := t.TempDir()
	mk := func(files ...string) string {
		d, err := os.MkdirTemp(dir, "d")
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range files {
			p := filepath.Join(d, f)
			if strings.HasSuffix(f, "/") {
				os.MkdirAll(p, 0o755)
				continue
			}
			os.MkdirAll(filepath.Dir(p), 0o755)
			os.WriteFile(p, []byte("{}"), 0o644)
		}
		return d
	}
	run := mk("config.yaml", "checkpoints/step-00000002/", "checkpoints/step-00000010/")
	fresh := mk("config.yaml")
	lora := mk("ckpts/checkpoints/step-00000004/config.json", "ckpts/checkpoints/step-00000004/adapter_config.json", "ckpts/checkpoints/step-00000004/adapter_model.safetensors")
	loraCk := filepath.Join(lora, "ckpts", "checkpoints", "step-00000004")
	for _, c := range []struct {
		dir, want string
	}{
		{run, "model.init_from: " + run + " is a student train run directory, not a checkpoint: point model.init_from at one of its checkpoints, e.g. " + filepath.Join(run, "checkpoints", "step-00000010")},
		{fresh, "model.init_from: " + fresh + " is a student train run directory with no checkpoint yet"},
		{loraCk, "model.init_from: " + loraCk + " is a LoRA run's checkpoint: it holds the adapters only (adapter_model.safetensors), not a model: export the merged model first (student export --checkpoint " + loraCk + " --format bf16 --out " + filepath.Join(lora, "ckpts") + "-merged)"},
		{mk("config.json", "model.safetensors"), ""},
		{mk("config.json", "adapter_config.json", "model.safetensors"), ""}, // merged beside its adapters
		{mk("config.json", "model.safetensors", "state.json", "optimizer.safetensors"), ""},
		{filepath.Join(dir, "missing"), ""},
		{"", ""},
	} {
		err := CheckInitFrom(c.dir)
		switch {
		case c.want == "" && err != nil:
			t.Errorf("CheckInitFrom(%s): %v, want nil", c.dir, err)
		case c.want != "" && (!errors.Is(err, ErrConfig) || err == nil || !strings.HasPrefix(err.Error(), c.want)):
			t.Errorf("CheckInitFrom(%s): %v\nwant ErrConfig starting %q", c.dir, err, c.want)
		}
	}
}
