package trainer

import (
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"distill/data/tokenizer"
	"distill/internal/testdirs"
	"distill/model"
)

// TestExportGenerationConfig: the export of a random-init student (no
// source has a generation_config.json) writes one from config.json and
// the tokenizer's EOS, and says so; a run that knows no EOS says why it
// wrote none.
func TestExportGenerationConfig(t *testing.T) {
	dir := t.TempDir()
	tokDir := filepath.Join(dir, "tok")
	os.MkdirAll(tokDir, 0o755)
	writeByteTokenizer(t, tokDir)
	os.WriteFile(filepath.Join(tokDir, "tokenizer_config.json"), []byte(`{"eos_token": "a", "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}`), 0o644)
	file := filepath.Join(dir, "chat.jsonl")
	writeJSONL(t, file, chatRecords(40, 1))
	runDir := filepath.Join(dir, "run")
	if _, err := Run(sftConfig(t, tokDir, file, runDir, "train.max_steps=3", "eval.every=0", "checkpoint.every=3"), Options{Log: io.Discard}); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(dir, "export")
	rep, err := Export(runDir, out, ExportOptions{})
	if err != nil {
		t.Fatal(err)
	}
	tk, err := tokenizer.Load(tokDir)
	if err != nil {
		t.Fatal(err)
	}
	eos, _ := tk.TokenID(tk.EOS())
	b, err := os.ReadFile(filepath.Join(out, "generation_config.json"))
	var g map[string]any
	if err == nil {
		err = json.Unmarshal(b, &g)
	}
	if err != nil || g["eos_token_id"] != float64(eos) || !strings.HasPrefix(rep.GenerationConfig, "written from config.json") {
		t.Errorf("generation_config.json %v (%v), report %q; want eos_token_id %d", g, err, rep.GenerationConfig, eos)
	}
	// --no-tokenizer: none, said so.
	rep, err = Export(runDir, filepath.Join(dir, "bare"), ExportOptions{NoTokenizer: true})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, "bare", "generation_config.json")); err == nil || rep.GenerationConfig == "" {
		t.Errorf("--no-tokenizer: generation_config.json written, or not said (%q)", rep.GenerationConfig)
	}
}

// TestExportNoCheckpoint: export (and eval, through LoadStudent) of a
// path that does not exist, or of a run directory whose run stopped
// before its first save (config.yaml and metrics.jsonl, with or without
// an empty checkpoints/), or of a directory that is no run or checkpoint,
// says so and what to do, and writes nothing; the run directory was
// taken for an HF checkpoint without config.json.
func TestExportNoCheckpoint(t *testing.T) {
	dir := t.TempDir()
	killed := filepath.Join(dir, "killed") // SIGKILLed before its first save
	os.MkdirAll(killed, 0o755)
	os.WriteFile(filepath.Join(killed, "config.yaml"), []byte("run_dir: x\n"), 0o644)
	os.WriteFile(filepath.Join(killed, "metrics.jsonl"), nil, 0o644)
	empty := filepath.Join(dir, "empty")
	os.MkdirAll(filepath.Join(empty, "checkpoints"), 0o755)
	os.WriteFile(filepath.Join(empty, "config.yaml"), []byte("run_dir: x\n"), 0o644)
	// A directory that is none of a run, a checkpoint and an HF model
	// (a run's parent: its runs are below it) says what it is not; it
	// said only "open DIR/config.json: no such file or directory".
	parent := filepath.Join(dir, "runs")
	os.MkdirAll(filepath.Join(parent, "student-kd"), 0o755)
	for _, tc := range []struct{ src, want string }{
		{filepath.Join(dir, "nope"), "nope: no such run or checkpoint directory"},
		{killed, "run directory " + killed + " has no checkpoint yet"},
		{empty, "run directory " + empty + " has no checkpoint yet"},
		{parent, parent + " is neither a student train run directory (no checkpoints/ or config.yaml) nor a checkpoint (no config.json): give a run directory"},
	} {
		out := filepath.Join(dir, "out")
		_, err := Export(tc.src, out, ExportOptions{})
		if err == nil || !strings.Contains(err.Error(), tc.want) || strings.Contains(err.Error(), "config.json: no such file") {
			t.Errorf("export %s: %v\nwant %q", tc.src, err, tc.want)
		}
		if _, err := os.Stat(out); err == nil {
			t.Errorf("export %s wrote %s", tc.src, out)
		}
	}
}

// TestExportChecksOutFirst: an --out that cannot be written is refused
// naming --out before the checkpoint is even read (here it does not
// exist): a mount point, or a directory nothing can be written beside,
// failed only after the model was loaded, and a mount point only after
// it was written beside it (model.CheckOut: TestWriteDirMountPoint).
func TestExportChecksOutFirst(t *testing.T) {
	ro := testdirs.Unwritable(t)
	out := filepath.Join(ro, "out")
	_, err := Export(filepath.Join(t.TempDir(), "nope"), out, ExportOptions{})
	if want := "--out: cannot write " + out + ": cannot create files in " + ro + " ("; err == nil || !strings.HasPrefix(err.Error(), want) {
		t.Errorf("export to %s: %v, want %q", out, err, want)
	}
}

// TestExportOutIsSource: an --out that is the directory being exported,
// or holds it, is refused before anything is removed. With --force the
// export replaced it whole: `student export --checkpoint run --out run
// --force` removed the run's checkpoints, metrics and config and exited
// 0; without --force the refusal said "give --force to replace it".
func TestExportOutIsSource(t *testing.T) {
	parent := t.TempDir()
	src := filepath.Join(parent, "model")
	mc, err := model.ParseConfig([]byte(`{"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 97, "hidden_size": 32,
		"num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "intermediate_size": 64,
		"max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000, "tie_word_embeddings": false}`))
	if err != nil {
		t.Fatal(err)
	}
	if err := model.WriteCheckpoint(src, mc, model.Init(mc, model.InitOptions{Seed: 1}), "F32"); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		out   string
		force bool
		want  string
	}{
		{src, true, "--out " + src + " is the directory being exported"},
		{src, false, "--out " + src + " is the directory being exported"},
		{parent, true, "--out " + parent + " holds the checkpoint being exported"},
		{src + "/", true, "is the directory being exported"},
	} {
		_, err := Export(src, tc.out, ExportOptions{Force: tc.force})
		if err == nil || !strings.Contains(err.Error(), tc.want) || strings.Contains(err.Error(), "give --force") {
			t.Errorf("export %s to %s (force %v): %v, want %q", src, tc.out, tc.force, err, tc.want)
		}
		if _, err := os.Stat(filepath.Join(src, "model.safetensors")); err != nil {
			t.Fatalf("export %s to %s (force %v) removed the source: %v", src, tc.out, tc.force, err)
		}
	}
	// A directory inside the source's, or beside it, is a new directory.
	for _, out := range []string{filepath.Join(src, "hf"), filepath.Join(parent, "model-bf16")} {
		if _, err := Export(src, out, ExportOptions{}); err != nil {
			t.Errorf("export %s to %s: %v", src, out, err)
		}
	}
}
