package serve

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"distill/internal/testdirs"
	"distill/model"
)

// weightlessModel is a checkpoint directory with the tiny model's
// config.json and no weights: a daemon started on it fails when it loads
// the weights, so an error about anything else came before the load.
func weightlessModel(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(tinyModel(t), "config.json"))
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "config.json"), b, 0o644); err != nil {
		t.Fatal(err)
	}
	return dir
}

// startErr starts a daemon that must fail, and returns its error.
func startErr(t *testing.T, cfg Config) error {
	t.Helper()
	if cfg.Listen == "" {
		cfg.Listen = "127.0.0.1:0"
	}
	if cfg.Metrics == "" {
		cfg.Metrics = "off"
	}
	d, err := Start(cfg, nil)
	if err == nil {
		d.Shutdown(context.Background())
		t.Fatalf("%+v: the daemon started", cfg)
	}
	return err
}

// TestCacheDirNotWritable: a --cache this process cannot write (or whose
// nearest existing parent it cannot write, for a cache the first fill
// creates) fails at startup, naming the flag; it used to start, load the
// teacher and answer every Fill with an internal error.
func TestCacheDirNotWritable(t *testing.T) {
	ro := testdirs.Unwritable(t)
	for _, c := range []struct{ dir, want string }{
		{ro, "--cache " + ro + ": it is not writable"},
		{filepath.Join(ro, "a", "cache"), "the directory it would be created in, " + ro + ", is not writable"},
	} {
		err := startErr(t, Config{Model: weightlessModel(t), Cache: c.dir})
		if !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), "give a directory this process can write") {
			t.Errorf("--cache %s: %v", c.dir, err)
		}
		// A fill needs its cache: the daemon's way out ("start without
		// --cache to serve Score only") sent it to "--model needs --cache".
		if _, err := NewCore(CoreOptions{ModelDir: tinyModel(t), CacheDir: c.dir, InProcess: true}); err == nil || !strings.Contains(err.Error(), c.want) ||
			!strings.HasSuffix(err.Error(), "the fill writes the cache, so give a directory this process can write") || strings.Contains(err.Error(), "Score only") {
			t.Errorf("cachectl fill --model --cache %s: %v", c.dir, err)
		}
		if err := startErr(t, Config{Model: weightlessModel(t), Cache: c.dir}); !strings.Contains(err.Error(), "or start without --cache to serve Score only") {
			t.Errorf("teacherd --cache %s: %v, want the way to serve Score only", c.dir, err)
		}
	}
	// A writable cache, missing or there, starts; the probe leaves nothing.
	parent := t.TempDir()
	for _, dir := range []string{filepath.Join(parent, "new", "cache"), parent} {
		d, err := Start(Config{Model: tinyModel(t), Cache: dir, Listen: "127.0.0.1:0", Metrics: "off"}, nil)
		if err != nil {
			t.Fatalf("--cache %s: %v", dir, err)
		}
		d.Shutdown(context.Background())
	}
	if ents, _ := os.ReadDir(parent); len(ents) != 0 {
		t.Errorf("the startup check left %v in the cache's parent", ents)
	}
	file := filepath.Join(parent, "file")
	os.WriteFile(file, []byte("x"), 0o644)
	if err := startErr(t, Config{Model: tinyModel(t), Cache: filepath.Join(file, "cache")}); !strings.Contains(err.Error(), file+" is a file, not a directory") {
		t.Errorf("--cache FILE/cache: %v", err)
	}
}

// TestBadValuesBeforeLoading: settings no daemon can run with fail
// before the port is bound and the weights load (the model has none
// here, so a later check would report those instead), naming the flag,
// or the config file's key where Sources says the value is the file's.
// A negative max_concurrent used to lift the RPC bound, a negative queue
// size to take the default, and a k or draws out of range to fail only
// once the weights had loaded.
func TestBadValuesBeforeLoading(t *testing.T) {
	m := weightlessModel(t) // vocab 512
	for _, c := range []struct {
		cfg  Config
		want string
	}{
		{Config{MaxConcurrent: -1}, "--max-concurrent -1: want a positive number"},
		{Config{QueueSamples: -1}, "--queue-samples -1"},
		{Config{QueueTokens: -5}, "--queue-tokens -5"},
		{Config{TokenBudget: -5}, "--token-budget -5"},
		{Config{MaxDraws: 99999}, "--max-draws 99999: want 1 to 4096"},
		{Config{MaxDraws: -1}, "--max-draws -1"},
		{Config{KMax: 1000}, "--k-max 1000: want 1 <= k-max <= 512"},
		{Config{KDefault: 600}, "--k-default 600: want 1 <= k-default <= 512"},
		{Config{DrainTimeout: -time.Second}, "--drain-timeout -1s"},
		{Config{KMax: -3}, "--k-max -3: want 1 or more"},
		{Config{KDefault: -1}, "--k-default -1: want 1 or more"},
		{Config{KDefault: 100, KMax: 10}, "--k-default 100: want 1 <= k-default <= 10 (--k-max)"},
		{Config{TLSCert: "/x"}, "--tls-cert /x: TLS needs --tls-key too"},
		{Config{TLSKey: "/k"}, "--tls-key /k: TLS needs --tls-cert too"},
		// Named as Sources says they came: the file's key, not a flag.
		{Config{KMax: 1000, Sources: Sources{File: "t.yaml", FromFile: map[string]bool{"k-max": true}}}, "config t.yaml: k_max: 1000: want 1 <= k_max <= 512"},
		{Config{KMax: -3, Sources: Sources{File: "t.yaml", FromFile: map[string]bool{"k-max": true}}}, "config t.yaml: k_max: -3: want 1 or more"},
		{Config{KDefault: 100, KMax: 10, Sources: Sources{File: "t.yaml", FromFile: map[string]bool{"k-max": true}}}, "--k-default 100: want 1 <= k-default <= 10 (k_max in config t.yaml)"},
		{Config{TLSKey: "/k", Sources: Sources{File: "t.yaml", FromFile: map[string]bool{"tls-key": true}}}, "config t.yaml: tls_key: /k: TLS needs tls_cert too"},
	} {
		c.cfg.Model = m
		err := startErr(t, c.cfg)
		if !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: %v, want %q", c.cfg, err, c.want)
		}
	}
	// A --tokenizer without tokenizer.json (it failed after the load, as
	// "failed precondition"), and TLS files that are not there.
	noTok := t.TempDir()
	if err := startErr(t, Config{Model: m, Tokenizer: noTok}); !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "--tokenizer "+noTok+": no tokenizer.json there (no such file or directory)") {
		t.Errorf("--tokenizer without tokenizer.json: %v", err)
	}
	if err := startErr(t, Config{Model: m, TLSCert: filepath.Join(noTok, "c.pem"), TLSKey: filepath.Join(noTok, "k.pem")}); !strings.Contains(err.Error(), "--tls-cert "+filepath.Join(noTok, "c.pem")+", --tls-key ") {
		t.Errorf("TLS files missing: %v", err)
	}
	// A token file that is not there names its flag.
	missing := filepath.Join(t.TempDir(), "token")
	if err := startErr(t, Config{Model: m, TokenFile: missing}); !strings.Contains(err.Error(), "--token-file "+missing+": no such file or directory: give the file that holds the bearer token") {
		t.Errorf("--token-file missing: %v", err)
	}
}

// TestPortsInUseBeforeLoading: a --listen or --metrics address another
// process holds fails before the weights load (the metrics port used to
// be bound after, so a busy one cost a whole load), naming the flag and
// the fix.
func TestPortsInUseBeforeLoading(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	taken := l.Addr().String()
	m := weightlessModel(t)
	for _, c := range []struct {
		cfg  Config
		flag string
	}{
		{Config{Model: m, Listen: taken}, "--listen"},
		{Config{Model: m, Metrics: taken}, "--metrics"},
	} {
		err := startErr(t, c.cfg)
		if want := c.flag + " " + taken + ": bind: address already in use: another process (another teacherd?) listens there: stop it, or give another " + c.flag + " address"; !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), want) {
			t.Errorf("%s taken: %v\nwant %q", c.flag, err, want)
		}
	}
	if err := startErr(t, Config{Model: m, Metrics: "9090"}); !strings.Contains(err.Error(), "--metrics 9090: address 9090: missing port in address: want HOST:PORT") {
		t.Errorf("--metrics 9090: %v", err)
	}
}

// TestLoadErrorNamesTheDirOnce: a teacher whose weights do not load says
// its directory once: it said "loading teacher DIR: DIR: model:
// safetensors: checkpoint does not match config.json: ...", and "loading
// teacher DIR: ... in DIR" for a directory without weights. The cause
// stays in the chain.
func TestLoadErrorNamesTheDirOnce(t *testing.T) {
	src := tinyModel(t)
	copyModel := func(edit func(config string) string) string {
		dir := t.TempDir()
		for _, f := range []string{"config.json", "model.safetensors"} {
			b, err := os.ReadFile(filepath.Join(src, f))
			if err != nil {
				t.Fatal(err)
			}
			if f == "config.json" {
				b = []byte(edit(string(b)))
			}
			os.WriteFile(filepath.Join(dir, f), b, 0o644)
		}
		return dir
	}
	twoLayers := copyModel(func(c string) string {
		return strings.Replace(c, `"num_hidden_layers": 1`, `"num_hidden_layers": 2`, 1)
	})
	truncated := copyModel(func(c string) string { return c })
	b, _ := os.ReadFile(filepath.Join(truncated, "model.safetensors"))
	os.WriteFile(filepath.Join(truncated, "model.safetensors"), b[:len(b)/2], 0o644)
	weightless := weightlessModel(t)
	for _, c := range []struct {
		dir, want string
	}{
		{twoLayers, "loading teacher " + twoLayers + ": checkpoint does not match config.json: missing tensor model.layers.1."},
		{twoLayers + "/", "loading teacher " + twoLayers + "/: checkpoint does not match config.json: missing tensor model.layers.1."},
		{weightless, "loading teacher: no model.safetensors, model.safetensors.index.json or *.safetensors in " + weightless},
		{truncated + "/", "loading teacher: " + filepath.Join(truncated, "model.safetensors") + ": tensor "},
	} {
		_, err := NewCore(CoreOptions{ModelDir: c.dir, Device: "cpu"})
		if err == nil || !strings.HasPrefix(err.Error(), c.want) || strings.Count(err.Error(), filepath.Clean(c.dir)) != 1 || !errors.Is(err, model.ErrSafetensors) {
			t.Errorf("--model %s: %v\nwant %q..., the directory once", c.dir, err, c.want)
		}
	}
}
