package trainer

import (
	"encoding/json"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"distill/train/loss"
)

// TestResumeTailDefinition: checkpoints record the loss definition and the
// objective. A checkpoint written before tail renormalize changed meaning
// (no loss_definition in state.json) is refused under tail: renormalize,
// naming the key and the way out (tail: zero), and resumes under tail:
// zero; a checkpoint from a newer definition is refused; a deliberate
// change of kd_loss or tail resumes with a note.
func TestResumeTailDefinition(t *testing.T) {
	b := testCache(t)
	runDir := t.TempDir()
	if _, err := Run(tinyConfig(t, b, runDir, "train.max_steps=2", "eval.every=0", "optim.warmup_steps=1", "distill.tail=renormalize"), Options{Log: io.Discard}); err != nil {
		t.Fatal(err)
	}
	ck, err := LatestCheckpoint(runDir)
	if err != nil || ck == "" {
		t.Fatalf("no checkpoint: %v", err)
	}
	st := readState(t, ck)
	if st["loss_definition"] != float64(loss.Definition) || st["tail"] != "renormalize" || st["kd_loss"] != "fwd_kl" {
		t.Fatalf("state.json records loss_definition %v, tail %v, kd_loss %v; want %d, renormalize, fwd_kl", st["loss_definition"], st["tail"], st["kd_loss"], loss.Definition)
	}
	// Same definition, same tail: resumes.
	if _, err := Run(tinyConfig(t, b, runDir, "train.max_steps=3", "eval.every=0", "optim.warmup_steps=1", "distill.tail=renormalize"), Options{Log: io.Discard}); err != nil {
		t.Fatal(err)
	}
	// As written before loss definition 2: no loss fields.
	ck, _ = LatestCheckpoint(runDir)
	st = readState(t, ck)
	delete(st, "loss_definition")
	delete(st, "tail")
	delete(st, "kd_loss")
	writeState(t, ck, st)
	for _, kd := range []string{"fwd_kl", "rev_kl", "jsd"} {
		_, err = Run(tinyConfig(t, b, runDir, "train.max_steps=4", "eval.every=0", "optim.warmup_steps=1", "distill.tail=renormalize", "distill.kd_loss="+kd), Options{Log: io.Discard})
		if !errors.Is(err, ErrResume) || !strings.Contains(err.Error(), "distill.tail: renormalize") || !strings.Contains(err.Error(), "set distill.tail: zero") {
			t.Fatalf("%s: old checkpoint resumed under the new renormalize: %v", kd, err)
		}
	}
	// tail: zero continues the old fwd_kl objective; bucket never changed.
	if _, err := Run(tinyConfig(t, b, runDir, "train.max_steps=4", "eval.every=0", "optim.warmup_steps=1", "distill.tail=zero"), Options{Log: io.Discard}); err != nil {
		t.Fatal(err)
	}
	ck, _ = LatestCheckpoint(runDir)
	if st = readState(t, ck); st["loss_definition"] != float64(loss.Definition) || st["tail"] != "zero" {
		t.Fatalf("after the resume, state.json records loss_definition %v, tail %v", st["loss_definition"], st["tail"])
	}
	// A deliberate change of tail is allowed and noted.
	var log strings.Builder
	if _, err := Run(tinyConfig(t, b, runDir, "train.max_steps=5", "eval.every=0", "optim.warmup_steps=1", "distill.tail=bucket"), Options{Log: &log}); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(log.String(), "the objective changed (kd_loss fwd_kl, tail zero -> kd_loss fwd_kl, tail bucket)") {
		t.Fatalf("a changed tail should be noted: %s", log.String())
	}
	// A definition from a newer build is refused.
	ck, _ = LatestCheckpoint(runDir)
	st = readState(t, ck)
	st["loss_definition"] = loss.Definition + 1
	writeState(t, ck, st)
	_, err = Run(tinyConfig(t, b, runDir, "train.max_steps=6", "eval.every=0", "optim.warmup_steps=1"), Options{Log: io.Discard})
	if !errors.Is(err, ErrResume) || !strings.Contains(err.Error(), "newer than this build") {
		t.Fatalf("checkpoint of a newer loss definition: %v", err)
	}
}

func readState(t *testing.T, ck string) map[string]any {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(ck, "state.json"))
	if err != nil {
		t.Fatal(err)
	}
	var st map[string]any
	if err := json.Unmarshal(b, &st); err != nil {
		t.Fatal(err)
	}
	return st
}

func writeState(t *testing.T, ck string, st map[string]any) {
	t.Helper()
	b, _ := json.MarshalIndent(st, "", "  ")
	if err := os.WriteFile(filepath.Join(ck, "state.json"), b, 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestDistillConfig: tail zero with rev_kl or jsd is a config error naming
// both keys; LoadEvalConfig takes a file with only a distill section (and
// data), or overrides alone, and still validates what it uses.
func TestDistillConfig(t *testing.T) {
	dir := t.TempDir()
	full := filepath.Join(dir, "full.yaml")
	os.WriteFile(full, []byte("run_dir: x\nmodel:\n  init_from: y\ndata:\n  cache: [z]\n"), 0o644)
	for _, kd := range []string{"rev_kl", "jsd"} {
		_, err := LoadConfig(full, []string{"distill.kd_loss=" + kd, "distill.tail=zero"})
		if !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "kd_loss "+kd+" with tail zero") || !strings.Contains(err.Error(), "infinite") {
			t.Errorf("%s with tail zero: %v", kd, err)
		}
	}
	if c, err := LoadConfig(full, []string{"distill.tail=zero"}); err != nil || c.Distill.Tail != "zero" {
		t.Fatalf("fwd_kl with tail zero: %v", err)
	}
	only := filepath.Join(dir, "distill.yaml")
	os.WriteFile(only, []byte("distill: {kd_loss: rev_kl, tail: renormalize, temperature: 2, sft_weight: 0.5}\ndata: {seq_len: 32, eval_range: [0, 4]}\n"), 0o644)
	if _, err := LoadConfig(only, nil); !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "run_dir") {
		t.Fatalf("LoadConfig of a distill-only file: %v (training needs run_dir)", err)
	}
	c, err := LoadEvalConfig(only, nil)
	if err != nil {
		t.Fatal(err)
	}
	if d := c.Distill; d.KDLoss != "rev_kl" || d.Tail != "renormalize" || d.Temperature != 2 || d.SFTWeight != 0.5 || d.KDWeight != 1 || c.Data.SeqLen != 32 {
		t.Fatalf("eval config %+v %+v", c.Distill, c.Data)
	}
	if _, err := LoadEvalConfig(full, nil); err != nil {
		t.Fatalf("a whole training config for eval: %v", err)
	}
	if c, err := LoadEvalConfig("", []string{"distill.kd_loss=jsd", "distill.jsd_beta=0.3"}); err != nil || c.Distill.KDLoss != "jsd" || c.Distill.JSDBeta != 0.3 {
		t.Fatalf("overrides alone: %v", err)
	}
	for over, want := range map[string]string{
		"distill.tail=zero":       "kd_loss rev_kl with tail zero",
		"distill.temperature=0":   "temperature",
		"data.seq_len=0":          "data.seq_len",
		"data.eval_range=[3,1]":   "data.eval_range",
		"distill.kd_weight=-1":    "kd_weight",
		"distill.tail=everything": "want bucket, renormalize or zero",
	} {
		if _, err := LoadEvalConfig(only, []string{over}); !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: %v", over, err)
		}
	}
	bad := filepath.Join(dir, "bad.yaml")
	os.WriteFile(bad, []byte("distill:\n  kd_los: fwd_kl\n"), 0o644)
	if _, err := LoadEvalConfig(bad, nil); !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "kd_los") {
		t.Fatalf("unknown key in an eval config: %v", err)
	}
}
