package main

import (
	"bytes"
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"distill/train/testcache"
	"distill/train/trainer"
)

// evalJSON runs `student eval` with args and decodes its --json output.
func evalJSON(t *testing.T, args ...string) (map[string]any, string) {
	t.Helper()
	var out bytes.Buffer
	stdout = &out
	defer func() { stdout = os.Stdout }()
	if err := runEval(append(args, "--json")); err != nil {
		t.Fatalf("eval %v: %v", args, err)
	}
	var m map[string]any
	if err := json.Unmarshal(out.Bytes(), &m); err != nil {
		t.Fatalf("eval %v printed %q: %v", args, out.String(), err)
	}
	return m, out.String()
}

// TestEvalLossFlags: `student eval` without a training config. The
// teacher is evaluated as a student on its own cache, so every proper
// (divergence, tail) gives KD ~ 0 (rev_kl under the old renormalize gave
// s·log s < 0 here, s the teacher's top-k mass). A config with only a
// distill and a data section and the same settings as flags give the same
// JSON, which holds every metric; flags override the config; bad
// settings are errors naming the keys.
func TestEvalLossFlags(t *testing.T) {
	dir := t.TempDir()
	b, err := testcache.Build(testcache.Options{Dir: dir, Vocab: 97, K: 8, Samples: 16, Chunk: 8, MinLen: 6, MaxLen: 30, Seed: 3})
	if err != nil {
		t.Fatal(err)
	}
	base := []string{"--checkpoint", b.TeacherDir, "--cache", b.CacheDir, "--tokenizer-fingerprint", "testcache-tokenizer", "--range", "0:8"}
	for _, c := range []struct{ kd, tail string }{
		{"fwd_kl", "bucket"}, {"rev_kl", "bucket"}, {"jsd", "bucket"},
		{"fwd_kl", "renormalize"}, {"rev_kl", "renormalize"}, {"jsd", "renormalize"},
	} {
		m, _ := evalJSON(t, append(base, "--kd-loss", c.kd, "--tail", c.tail)...)
		kd := m["kd"].(float64)
		if !(kd >= -1e-6 && kd < 1e-3) {
			t.Errorf("%s/%s: the teacher against its own top-k has KD %g, want ~0", c.kd, c.tail, kd)
		}
		if d := m["distill"].(map[string]any); d["kd_loss"] != c.kd || d["tail"] != c.tail {
			t.Errorf("%s/%s: report says %v", c.kd, c.tail, d)
		}
	}
	// zero: cross-entropy against the renormalized top-k, so KD is at least
	// -log of the student's top-k mass, > 0 for a teacher with a tail.
	if m, _ := evalJSON(t, append(base, "--tail", "zero")...); !(m["kd"].(float64) > 1e-3) {
		t.Errorf("zero: KD %v, want > 0 (the teacher's own tail mass)", m["kd"])
	}

	// A distill-only config equals the same settings as flags.
	cfg := filepath.Join(dir, "distill.yaml")
	os.WriteFile(cfg, []byte("distill: {kd_loss: jsd, jsd_beta: 0.3, tail: renormalize, temperature: 2, scale_t2: true, sft_weight: 0.5, kd_weight: 0.7}\n"+
		"data: {cache: ["+b.CacheDir+"], seq_len: 40, eval_range: [0, 8]}\n"), 0o644)
	fromCfg, js1 := evalJSON(t, "--checkpoint", b.TeacherDir, "--config", cfg, "--tokenizer-fingerprint", "testcache-tokenizer")
	_, js2 := evalJSON(t, append(base, "--kd-loss", "jsd", "--jsd-beta", "0.3", "--tail", "renormalize", "--temperature", "2", "--scale-t2",
		"--sft-weight", "0.5", "--kd-weight", "0.7", "--seq-len", "40")...)
	if js1 != js2 {
		t.Fatalf("config and flags differ:\n%s%s", js1, js2)
	}
	for _, f := range reflect.VisibleFields(reflect.TypeOf(trainer.EvalStats{})) {
		key := strings.Split(f.Tag.Get("json"), ",")[0]
		if _, ok := fromCfg[key]; !ok {
			t.Errorf("--json lacks the metric %q: %s", key, js1)
		}
	}
	if l, kd, ce := fromCfg["loss"].(float64), fromCfg["kd"].(float64), fromCfg["ce"].(float64); math.Abs(l-(0.7*4*kd+0.5*ce)) > 1e-9*math.Abs(l) {
		t.Errorf("loss %g, want kd_weight·T²·kd + sft_weight·ce = %g", l, 0.7*4*kd+0.5*ce)
	}
	if fromCfg["tokens"].(float64) <= 0 || fromCfg["samples"].(float64) != 8 {
		t.Errorf("tokens %v, samples %v", fromCfg["tokens"], fromCfg["samples"])
	}
	// Flags override the config.
	m, _ := evalJSON(t, "--checkpoint", b.TeacherDir, "--config", cfg, "--tokenizer-fingerprint", "testcache-tokenizer", "--tail", "bucket", "--temperature", "1")
	if d := m["distill"].(map[string]any); d["tail"] != "bucket" || d["temperature"] != 1.0 || d["kd_loss"] != "jsd" || d["jsd_beta"] != 0.3 {
		t.Errorf("flags over the config: %v", d)
	}
	// The text output names the loss.
	var out bytes.Buffer
	stdout = &out
	err = runEval(append(base, "--tail", "renormalize", "--kd-loss", "rev_kl"))
	stdout = os.Stdout
	if err != nil || !strings.Contains(out.String(), "kd(rev_kl, tail renormalize, T 1)") {
		t.Errorf("text output %q, %v", out.String(), err)
	}

	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--kd-loss", "rev_kl", "--tail", "zero"}, "kd_loss rev_kl with tail zero"},
		{[]string{"--kd-loss", "jsd", "--tail", "zero"}, "kd_loss jsd with tail zero"},
		{[]string{"--tail", "everything"}, "want bucket, renormalize or zero"},
		{[]string{"--kd-loss", "kl"}, "kd_loss"},
		{[]string{"--tail", "bucket", "--temperature", "2"}, "captured at 1"},
		{[]string{"--temperature", "-1"}, "temperature"},
		{[]string{"--jsd-beta", "2", "--kd-loss", "jsd"}, "beta"},
	} {
		err := runEval(append(base, c.args...))
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("eval %v: %v, want an error mentioning %q", c.args, err, c.want)
		}
	}
}
