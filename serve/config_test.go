package serve

import (
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"
)

// TestLoadConfigErrors: a config file's mistakes name the key, its line
// and what is wanted (yaml.v3's own errors named Go types), and a float
// for an integer key is refused rather than truncated.
func TestLoadConfigErrors(t *testing.T) {
	dir := t.TempDir()
	for _, c := range []struct{ yaml, want string }{
		{"model: /m\nmodle: x\n", "line 2: unknown key modle (did you mean model?)"},
		{"model: /m\ndata_root: /d\n", "line 2: unknown key data_root (did you mean data_roots?)"},
		{"model: /m\nwhatever: 1\n", "line 2: unknown key whatever (the keys: model, tokenizer, listen,"},
		{"model: /m\ntoken_budget: lots\n", `line 2: token_budget: "lots" is not a whole number`},
		{"model: /m\ntoken_budget: 40.5\n", `line 2: token_budget: "40.5" is not a whole number`},
		{"drain_timeout: 30\n", `line 1: drain_timeout: "30" is not a duration: a number with its unit, e.g. 30s`},
		{"insecure: maybe\n", `line 1: insecure: "maybe" is not true or false`},
		{"data_roots: /d\n", `line 1: data_roots: "/d" is not a list`},
		{"model: [a, b]\n", "line 1: model: a list is not a string"},
		{"model: /m\nmodel: /n\n", "line 2: key model given again (first on line 1)"},
		{"", "is empty: give at least model: DIR"},
		{"# only a comment\n", "is empty"},
		{"/models/x\n", "line 1: want a mapping of keys to values"},
	} {
		p := filepath.Join(dir, "t.yaml")
		os.WriteFile(p, []byte(c.yaml), 0o644)
		_, err := LoadConfig(p)
		if !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), c.want) || strings.Contains(err.Error(), "serve.Config") {
			t.Errorf("%q: %v\nwant %q", c.yaml, err, c.want)
		}
	}
	p := filepath.Join(dir, "ok.yaml")
	os.WriteFile(p, []byte("model: /m\ndata_roots: [/a]\ntoken_budget: 512\ndrain_timeout: 5s\ninsecure: true\nlisten: 127.0.0.1:1\n"), 0o644)
	c, err := LoadConfig(p)
	if err != nil || c.Model != "/m" || len(c.DataRoots) != 1 || c.TokenBudget != 512 || c.DrainTimeout != 5*time.Second || !c.Insecure || c.Listen != "127.0.0.1:1" {
		t.Errorf("%+v, %v", c, err)
	}
	// The keys the file gives, by flag, for errors that name them.
	if src := c.Sources; src.File != p || !src.FromFile["token-budget"] || !src.FromFile["listen"] || src.FromFile["k-max"] || src.Said("listen") != "config "+p+": listen:" || src.Said("k-max") != "--k-max" {
		t.Errorf("sources: %+v", src)
	}
	if _, err := LoadConfig(filepath.Join(dir, "none.yaml")); err == nil || !strings.Contains(err.Error(), "--config "+filepath.Join(dir, "none.yaml")+": no such file or directory") {
		t.Errorf("missing config: %v", err)
	}
}

// TestSettingKeys: each value CheckSetting checks names a key of the
// config file that sets it (a bad value from the file is named by it).
func TestSettingKeys(t *testing.T) {
	keys := map[string]bool{}
	typ := reflect.TypeOf(Config{})
	for i := 0; i < typ.NumField(); i++ {
		keys[typ.Field(i).Tag.Get("yaml")] = true
	}
	for _, s := range settings {
		if !keys[s.key] || s.key != strings.ReplaceAll(s.flag, "-", "_") {
			t.Errorf("setting --%s: key %q is not its config key", s.flag, s.key)
		}
	}
}
