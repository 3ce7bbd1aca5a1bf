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
	if _, err := LoadConfig(p, nil); !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "line 14: unknown key data.seq_lenn (did you mean data.seq_len?)") {
		t.Errorf("unknown key on line 14: %v", err)
	}
	os.WriteFile(p, []byte(strings.Replace(text, "seq_lenn: 5", "seq_len: 5", 1)+"\n# optimizer\n\noptim:\n  lr: 0.1\n  beta1: 0.9\n"), 0o644)
	if _, err := LoadConfig(p, nil); err != nil {
		t.Fatal(err)
	}
	for over, want := range map[string]string{
		"optim.lrr=1e-3":      "--set optim.lrr=1e-3: unknown key optim.lrr (did you mean optim.lr?)",
		"optim.beta1=abc":     `--set optim.beta1=abc: optim.beta1: "abc" is not a number: write one, e.g. 0.9 or 3e-4`,
		"optim=1":             `--set optim=1: optim: "1" is a value, and optim is a section: give its keys (optim's keys: lr, min_lr,`,
		"train.max_steps=1.5": `--set train.max_steps=1.5: train.max_steps: "1.5" is not an integer`,
		"optim.lr=-1":         "c.yaml with --set train.max_steps=3 --set optim.lr=-1: optim.lr: -1: want > 0",
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

// TestConfigUnknownKeys: a key the config does not have is named by its
// path (not a Go type) and line, with the key it most likely meant, or
// else its section's keys; every unknown key of the file is listed, and
// one in a list that decodes itself (distill.teachers) is refused too
// (it was dropped silently).
func TestConfigUnknownKeys(t *testing.T) {
	p := filepath.Join(t.TempDir(), "c.yaml")
	for _, tc := range []struct {
		name, text string
		over       []string
		want       []string
	}{
		{"typo", "run_dir: x\noptim:\n  lrr: 0.1\n", nil,
			[]string{"c.yaml: line 3: unknown key optim.lrr (did you mean optim.lr?)"}},
		{"transposed top-level key", "run_dir: x\ntrian:\n  max_steps: 3\n", nil,
			[]string{"line 2: unknown key trian (did you mean train?)"}},
		{"no near key: the section's keys", "optim:\n  learning_rate: 0.1\n", nil,
			[]string{"line 2: unknown key optim.learning_rate (optim's keys: lr, min_lr, lr_schedule,"}},
		{"every unknown key", "optim:\n  lrr: 0.1\ntrain:\n  max_step: 3\n", nil,
			[]string{"2 unknown keys:", "line 2: unknown key optim.lrr", "line 4: unknown key train.max_step (did you mean train.max_steps?)"}},
		{"nested", "data:\n  dataset:\n    collumns: {text: t}\n", nil,
			[]string{"line 3: unknown key data.dataset.collumns (did you mean data.dataset.columns?)"}},
		{"in a list of entries", "data:\n  caches:\n    - {dir: a, nmae: x}\n", nil,
			[]string{"line 3: unknown key data.caches[0].nmae (did you mean data.caches[0].name?)"}},
		{"in distill.teachers", "distill:\n  teachers:\n    - {addres: [h:1], name: a}\n", nil,
			[]string{"line 3: unknown key distill.teachers[0].addres (did you mean distill.teachers[0].addrs?)"}},
		{"an override", "run_dir: x\n", []string{"optim.warmup_step=3"},
			[]string{"--set optim.warmup_step=3: unknown key optim.warmup_step (did you mean optim.warmup_steps?)"}},
	} {
		os.WriteFile(p, []byte(tc.text), 0o644)
		_, err := LoadConfig(p, tc.over)
		if !errors.Is(err, ErrConfig) {
			t.Errorf("%s: %v, want ErrConfig", tc.name, err)
			continue
		}
		for _, w := range tc.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("%s: %v\nwant %q", tc.name, err, w)
			}
		}
		if strings.Contains(err.Error(), "trainer.") || strings.Contains(err.Error(), "trainer:") {
			t.Errorf("%s: %v names a Go type", tc.name, err)
		}
	}
}

// TestConfigErrorsSayConfigOnce: a bad value of the config says the key
// once and what is wrong, ErrConfig in its chain and not in its text; a
// model.random value that package model refuses no longer says config
// twice ("trainer: bad config: model.random: model: config: ..."), and
// no package's sentinel ("trainer: bad config", "loss: invalid input")
// is in front of the key.
func TestConfigErrorsSayConfigOnce(t *testing.T) {
	p := filepath.Join(t.TempDir(), "c.yaml")
	os.WriteFile(p, []byte("run_dir: x\ndata: {cache: [z]}\nmodel:\n  random: {arch: qwen3, num_attention_heads: 4, num_key_value_heads: 2}\n"), 0o644)
	if _, err := LoadConfig(p, nil); err != nil {
		t.Fatal(err)
	}
	for over, want := range map[string]string{
		"model.random.num_attention_heads=3": "c.yaml with --set model.random.num_attention_heads=3: model.random: num_attention_heads 3 is not a multiple of num_key_value_heads 2",
		"model.random.arch=gpt2":             `c.yaml with --set model.random.arch=gpt2: model.random.arch: unknown architecture "gpt2": want llama, qwen2, qwen3 or qwen3_moe`,
		"model.random.head_dim=7":            "c.yaml with --set model.random.head_dim=7: model.random: head_dim 7 must be positive and even (RoPE rotates pairs)",
		"model.random.hidden_size=-3":        "c.yaml with --set model.random.hidden_size=-3: model.random.hidden_size: -3: want > 0",
		"optim.lr=-1":                        "c.yaml with --set optim.lr=-1: optim.lr: -1: want > 0 (e.g. 3e-4)",
		"optim.min_lr=1":                     "c.yaml with --set optim.min_lr=1: optim.min_lr: 1: want 0 <= min_lr <= optim.lr (0.0001)",
		"optim.lr_schedule=cos":              `c.yaml with --set optim.lr_schedule=cos: optim.lr_schedule: "cos": want constant, cosine or linear`,
		"optim.warmup_steps=1000":            "c.yaml with --set optim.warmup_steps=1000: optim.warmup_steps: 1000: a cosine schedule needs train.max_steps (1000) > warmup_steps: lower it, or use lr_schedule: constant",
		"optim.beta1=1":                      "c.yaml with --set optim.beta1=1: optim.beta1: 1: want 0 <= beta1 < 1 (e.g. 0.9)",
		"optim.beta2=-0.5":                   "c.yaml with --set optim.beta2=-0.5: optim.beta2: -0.5: want 0 <= beta2 < 1 (e.g. 0.95)",
		"optim.eps=0":                        "c.yaml with --set optim.eps=0: optim.eps: 0: want > 0 (e.g. 1e-8)",
		"optim.weight_decay=-1":              "c.yaml with --set optim.weight_decay=-1: optim.weight_decay: -1: want >= 0",
		"distill.kd_loss=kl":                 `c.yaml with --set distill.kd_loss=kl: distill: kd_loss "kl": want fwd_kl, rev_kl or jsd`,
	} {
		_, err := LoadConfig(p, []string{over})
		if !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), want) {
			t.Errorf("--set %s: %v\nwant ErrConfig and %q", over, err, want)
			continue
		}
		if msg := err.Error(); strings.Contains(msg, "bad config") || strings.Contains(msg, "config: ") || strings.Contains(msg, "invalid input") || strings.Contains(msg, "invalid configuration") {
			t.Errorf("--set %s: %q says config more than once, or a package sentinel's text", over, msg)
		}
	}
}

// TestConfigTypeErrors: a value of the wrong kind is named by its key and
// line, as a non-integer for an integer key is ("line 6: cannot
// unmarshal !!str `fast` into float64" named neither the key nor what to
// write; "optim: 1" named a Go type, trainer.OptimConfig).
func TestConfigTypeErrors(t *testing.T) {
	p := filepath.Join(t.TempDir(), "c.yaml")
	for _, tc := range []struct{ text, want string }{
		{"run_dir: x\noptim:\n  lr: fast\n", `c.yaml: optim.lr: "fast" is not a number (line 3): write one, e.g. 0.9 or 3e-4`},
		{"run_dir: x\noptim:\n  lr: \"3e-4\"\n", `c.yaml: optim.lr: "3e-4" is not a number (line 3): write one, e.g. 0.9 or 3e-4`},
		{"run_dir: x\noptim: fast\n", `c.yaml: optim: "fast" is a value (line 2), and optim is a section: give its keys (optim's keys: lr, min_lr,`},
	} {
		os.WriteFile(p, []byte(tc.text), 0o644)
		_, err := LoadConfig(p, nil)
		if !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: %v\nwant %q", tc.text, err, tc.want)
		}
	}
	// Numbers a float key takes: integers, .inf, and null (the default).
	os.WriteFile(p, []byte("run_dir: x\ndata: {cache: [z]}\nmodel: {random: {arch: qwen3}}\noptim: {lr: 1, min_lr: ~, weight_decay: 0.0}\n"), 0o644)
	if _, err := LoadConfig(p, nil); err != nil {
		t.Errorf("numbers a float key takes: %v", err)
	}
}
