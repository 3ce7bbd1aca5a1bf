package serve

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"gopkg.in/yaml.v3"

	"distill/cache"
	"distill/compute/device"
	"distill/infer"
	"distill/internal/errkind"
	"distill/internal/suggest"
	"distill/model"
)

// Config is teacherd's configuration, from flags and/or a YAML file (the
// yaml keys below; flags override the file).
type Config struct {
	// Model is the HF checkpoint directory (required).
	Model string `yaml:"model"`
	// Tokenizer is the tokenizer directory; empty: the model directory.
	Tokenizer string `yaml:"tokenizer"`
	// Listen is the gRPC address (default 127.0.0.1:7070: loopback only).
	// An address other machines can reach needs TokenFile or TLS, or
	// Insecure.
	Listen string `yaml:"listen"`
	// Metrics is the address of the Prometheus /metrics endpoint (default
	// 127.0.0.1:9090; "off" disables it).
	Metrics string `yaml:"metrics"`
	// Cache is the cache directory fills write (empty: Fill disabled).
	Cache string `yaml:"cache"`
	// DataRoots are the directories whose files clients may name as
	// datasets (--data-root, repeatable); none: no dataset file is
	// readable, so Fill and DescribeDataset are refused.
	DataRoots []string `yaml:"data_roots"`
	// Device is auto, cpu or cuda (package compute/device).
	Device string `yaml:"device"`
	// Weights is bf16 (default) or fp8: the teacher's layers' Linear
	// weights in E4M3, quantized at load (serve.CoreOptions.Weights).
	Weights string `yaml:"weights"`
	// Devices splits the teacher's layers over GPUs, a pipeline stage
	// each: ordinals "0,1,2,3" (one may repeat: stages sharing a GPU) or
	// "all" (compute/device.ParseDevices). Empty: one device.
	Devices string `yaml:"devices"`
	// MicroBatches cuts each forward of a pipelined teacher into that many
	// micro-batches (0: four a GPU, none under 1024 tokens).
	MicroBatches int `yaml:"micro_batches"`
	// TokenBudget is the tokens of one forward pass.
	TokenBudget int `yaml:"token_budget"`
	// MaxConcurrent bounds concurrent RPCs (default 64).
	MaxConcurrent int `yaml:"max_concurrent"`
	// QueueSamples and QueueTokens bound the work queue.
	QueueSamples int `yaml:"queue_samples"`
	QueueTokens  int `yaml:"queue_tokens"`
	// KDefault and KMax: the k of requests that give none, and the largest.
	KDefault int `yaml:"k_default"`
	KMax     int `yaml:"k_max"`
	// MaxDraws is the most draws per position a Fill or Score of sampled
	// targets may ask for (default 64): a GPU teacher plans its memory for it.
	MaxDraws int `yaml:"max_draws"`
	// TLSCert and TLSKey enable TLS (both or neither).
	TLSCert string `yaml:"tls_cert"`
	TLSKey  string `yaml:"tls_key"`
	// TokenFile holds the bearer token clients must send (empty: no auth).
	TokenFile string `yaml:"token_file"`
	// Insecure allows a non-loopback Listen without a token or TLS (a
	// trusted network). Without it such a daemon refuses to start.
	Insecure bool `yaml:"insecure"`
	// DrainTimeout bounds the graceful shutdown: in-flight RPCs get this
	// long to finish, then fills are cancelled and their chunks aborted.
	DrainTimeout time.Duration `yaml:"drain_timeout"`

	// Sources says which of the values above came from a config file,
	// for the errors that name them (not a key of the file).
	Sources Sources `yaml:"-"`
}

// Sources says where a Config's values came from, so that an error names
// a value as the user gave it: by teacherd's flag (`--k-max 100: ...`),
// or by the config file's key (`config t.yaml: k_max: 100: ...`), not by
// a flag the user never typed. The zero Sources names every value by its
// flag.
type Sources struct {
	// File is the config file the values FromFile names came from.
	File string
	// FromFile holds the settings, by teacherd flag name ("k-max"),
	// whose value is File's: LoadConfig sets those File gives, and
	// teacherd clears those a flag given overrides.
	FromFile map[string]bool
}

// fromFile reports whether the value of the setting flag is File's.
func (s Sources) fromFile(flag string) bool { return s.File != "" && s.FromFile[flag] }

// configKey is the config file's key of teacherd's flag named flag: the
// flag's name with _ for -, but for the repeatable --data-root, whose key
// is the list data_roots (TestSettingKeys holds the settings to it).
func configKey(flag string) string {
	if flag == "data-root" {
		return "data_roots"
	}
	return strings.ReplaceAll(flag, "-", "_")
}

// flagOfKey is configKey's inverse.
func flagOfKey(key string) string {
	if key == "data_roots" {
		return "data-root"
	}
	return strings.ReplaceAll(key, "_", "-")
}

// Said is how an error begins that names the value of the setting
// teacherd's flag flag sets: "--k-max", or "config FILE: k_max:" for the
// file's value.
func (s Sources) Said(flag string) string {
	if s.fromFile(flag) {
		return "config " + s.File + ": " + configKey(flag) + ":"
	}
	return "--" + flag
}

// word is the setting's bare name, as its source spells it: "k-max" or
// "k_max".
func (s Sources) word(flag string) string { return s.wordLike(flag, flag) }

// wordLike is the bare name of the setting flag, which has no value, as
// the source of the setting as spells it.
func (s Sources) wordLike(flag, as string) string {
	if s.fromFile(as) {
		return configKey(flag)
	}
	return flag
}

// ref names the setting flag inside a message about the setting about:
// "--k-max", or "k_max in config FILE" ("k_max" when the message names
// the file already).
func (s Sources) ref(flag, about string) string {
	switch {
	case !s.fromFile(flag):
		return "--" + flag
	case s.fromFile(about):
		return configKey(flag)
	}
	return configKey(flag) + " in config " + s.File
}

// hint names the setting flag in a message's advice, as its value came:
// "no --tokenizer", or "no tokenizer" for the file's.
func (s Sources) hint(flag string) string { return s.like(flag, flag) }

// like names the setting flag, which has no value, the way the value of
// the setting as is named: "--tls-key" beside a flag, "tls_key" beside
// the file's key (its value is missing from both alike).
func (s Sources) like(flag, as string) string {
	if s.fromFile(as) {
		return configKey(flag)
	}
	return "--" + flag
}

// LoadConfig reads a YAML config file; unknown keys are an error naming
// them, with the key most likely meant, and a value of the wrong kind is
// an error naming its key and the kind wanted (yaml.v3's own errors named
// a Go type instead: "field modle not found in type serve.Config",
// "cannot unmarshal !!str `lots` into int").
func LoadConfig(path string) (Config, error) {
	var c Config
	src, err := os.ReadFile(path)
	if err != nil {
		return c, configErrorf("--config %s: %v", path, unwrapPath(err))
	}
	var root yaml.Node
	if err := yaml.Unmarshal(src, &root); err != nil {
		return c, configErrorf("config %s: %v", path, err)
	}
	if len(root.Content) == 0 {
		return c, configErrorf("config %s is empty: give at least model: DIR (examples/teacherd.yaml documents every key)", path)
	}
	m := root.Content[0]
	if m.Kind != yaml.MappingNode {
		return c, configErrorf("config %s: line %d: want a mapping of keys to values, e.g. model: /models/Qwen3-8B (examples/teacherd.yaml documents every key)", path, m.Line)
	}
	fields := map[string]reflect.Value{}
	var names []string
	cv := reflect.ValueOf(&c).Elem()
	for i := 0; i < cv.NumField(); i++ {
		name, _, _ := strings.Cut(cv.Type().Field(i).Tag.Get("yaml"), ",")
		if name == "-" {
			continue // Sources
		}
		fields[name] = cv.Field(i)
		names = append(names, name)
	}
	seen := map[string]int{}
	for i := 0; i+1 < len(m.Content); i += 2 {
		k, v := m.Content[i], m.Content[i+1]
		if l, ok := seen[k.Value]; ok {
			return c, configErrorf("config %s: line %d: key %s given again (first on line %d): keep one", path, k.Line, k.Value, l)
		}
		seen[k.Value] = k.Line
		f, ok := fields[k.Value]
		if !ok {
			hint := "the keys: " + strings.Join(names, ", ") + "; examples/teacherd.yaml documents each"
			if s := suggest.Closest(k.Value, names); s != "" {
				hint = "did you mean " + s + "?"
			}
			return c, configErrorf("config %s: line %d: unknown key %s (%s)", path, k.Line, k.Value, hint)
		}
		err := v.Decode(f.Addr().Interface())
		if f.Kind() == reflect.Int && v.Kind == yaml.ScalarNode && v.ShortTag() != "!!int" && v.ShortTag() != "!!null" {
			err = errors.New("not an integer") // yaml.v3 truncates 40.5 to 40
		}
		if err != nil {
			got := fmt.Sprintf("%q", v.Value)
			switch v.Kind {
			case yaml.SequenceNode:
				got = "a list"
			case yaml.MappingNode:
				got = "a mapping"
			}
			return c, configErrorf("config %s: line %d: %s: %s is not %s", path, v.Line, k.Value, got, wantKind(f.Type()))
		}
	}
	// By flag name (configKey's inverse).
	c.Sources = Sources{File: path, FromFile: map[string]bool{}}
	for k := range seen {
		c.Sources.FromFile[flagOfKey(k)] = true
	}
	return c, nil
}

// wantKind says what a config value of type t is written as.
func wantKind(t reflect.Type) string {
	switch {
	case t == reflect.TypeOf(time.Duration(0)):
		return "a duration: a number with its unit, e.g. 30s or 2m"
	case t.Kind() == reflect.Int:
		return "a whole number"
	case t.Kind() == reflect.Bool:
		return "true or false"
	case t.Kind() == reflect.Slice:
		return "a list, e.g. [/data/chat, /data/code]"
	}
	return "a string"
}

func (c *Config) defaults() {
	if c.Listen == "" {
		c.Listen = "127.0.0.1:7070"
	}
	if c.Metrics == "" {
		c.Metrics = "127.0.0.1:9090"
	}
	if c.MaxConcurrent == 0 {
		c.MaxConcurrent = 64
	}
	if c.DrainTimeout == 0 {
		c.DrainTimeout = 30 * time.Second
	}
}

// Daemon is a running teacherd: gRPC listener, metrics endpoint, core.
type Daemon struct {
	cfg     Config
	log     *zap.Logger
	gs      *grpc.Server
	srv     *Server
	lis     net.Listener
	mlis    net.Listener
	metrics *http.Server
	core    *Core
}

// Addr is the gRPC listen address (useful with port 0).
func (d *Daemon) Addr() string { return d.lis.Addr().String() }

// MetricsAddr is the /metrics listen address, "" when disabled.
func (d *Daemon) MetricsAddr() string {
	if d.mlis == nil {
		return ""
	}
	return d.mlis.Addr().String()
}

// Core returns the loaded core (nil while loading).
func (d *Daemon) Core() *Core { return d.core }

// Start listens, then loads the model (health NOT_SERVING meanwhile) and
// serves. It returns once the model is loaded and the daemon serves.
func Start(cfg Config, log *zap.Logger) (*Daemon, error) {
	cfg.defaults()
	if log == nil {
		log = zap.NewNop()
	}
	if cfg.Model == "" {
		return nil, configErrorf("no model: give --model DIR or model: in the config")
	}
	// A bad value is refused before listening: a probe must not see a
	// half-started daemon. A device that does not open (no driver) fails
	// in NewCore, before the daemon serves.
	for _, s := range settings {
		if err := cfg.CheckSetting(s.flag); err != nil {
			return nil, err
		}
	}
	if _, err := cfg.CheckPairs(); err != nil {
		return nil, err
	}
	devices, err := device.ParseDevices(cfg.Devices)
	if err != nil {
		return nil, errkind.Wrap(ErrConfig, err)
	}
	if len(devices) > 0 {
		// --device cpu --devices 0,1 was refused by NewCore, after the
		// daemon had said it listens.
		if err := device.CheckStages(cfg.Device, devices); err != nil {
			return nil, errkind.Wrap(ErrConfig, err)
		}
	}
	if err := checkCacheDir(cfg.Cache, cfg.Sources, false); err != nil {
		return nil, err
	}
	// The model's config.json too, so that a mistyped --model fails
	// before the port is bound (the weights load after, NOT_SERVING).
	mc, err := model.LoadConfig(cfg.Model)
	if err != nil {
		return nil, configErrorf("%s %s: %w", cfg.Sources.Said("model"), cfg.Model, err)
	}
	if err := cfg.CheckK(mc.VocabSize); err != nil {
		return nil, err
	}
	// A --tokenizer without tokenizer.json failed only after the weights
	// had loaded (as "failed precondition").
	if cfg.Tokenizer != "" {
		if _, err := os.Stat(filepath.Join(cfg.Tokenizer, "tokenizer.json")); err != nil {
			return nil, configErrorf("%s %s: no tokenizer.json there (%v): give the directory that holds the teacher's tokenizer.json, or no %s for the model directory's",
				cfg.Sources.Said("tokenizer"), cfg.Tokenizer, unwrapPath(err), cfg.Sources.hint("tokenizer"))
		}
	}
	roots, err := NewDataRoots(cfg.DataRoots, cfg.Sources.Said("data-root"))
	if err != nil {
		return nil, err
	}
	if len(roots.Dirs()) == 0 {
		log.Warn("no --data-root: clients can name no dataset file, so Fill and DescribeDataset are refused; Score works")
	}
	so := ServerOptions{MaxConcurrent: cfg.MaxConcurrent, Logger: log, DataRoots: roots}
	if cfg.TokenFile != "" {
		b, err := os.ReadFile(cfg.TokenFile)
		if err != nil {
			return nil, configErrorf("%s %s: %v: give the file that holds the bearer token clients send (one line), or no %s for no authentication",
				cfg.Sources.Said("token-file"), cfg.TokenFile, unwrapPath(err), cfg.Sources.hint("token-file"))
		}
		// Trimmed as the clients trim it (teacherdial.ReadToken): the
		// same file on both sides is the same token.
		so.Token = strings.TrimSpace(string(b))
		if so.Token == "" {
			return nil, configErrorf("%s %s is empty: write the bearer token clients send into it (one line)", cfg.Sources.Said("token-file"), cfg.TokenFile)
		}
	}
	if cfg.TLSCert != "" {
		cert, err := tls.LoadX509KeyPair(cfg.TLSCert, cfg.TLSKey)
		if err != nil {
			return nil, configErrorf("%s %s, %s %s: %v: give a PEM certificate and its private key", cfg.Sources.Said("tls-cert"), cfg.TLSCert, cfg.Sources.Said("tls-key"), cfg.TLSKey, err)
		}
		so.Extra = append(so.Extra, grpc.Creds(credentials.NewTLS(&tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12})))
	}
	d := &Daemon{cfg: cfg, log: log}
	if d.lis, err = net.Listen("tcp", cfg.Listen); err != nil {
		return nil, listenError(cfg.Sources.Said("listen"), cfg.Sources.hint("listen"), cfg.Listen, err)
	}
	// Checked on the bound address: a host name or an empty host ("":7070,
	// every interface) is judged by what the socket really listens on.
	if ta, ok := d.lis.Addr().(*net.TCPAddr); !ok || !ta.IP.IsLoopback() {
		if so.Token == "" && cfg.TLSCert == "" && !cfg.Insecure {
			d.lis.Close()
			return nil, configErrorf("%s %s is reachable from other machines (%s), and the daemon has no --token-file and no TLS: anyone who reaches it could use the teacher; "+
				"give --token-file FILE (and TLS: --tls-cert, --tls-key), listen on loopback (127.0.0.1), or pass --insecure on a trusted network", cfg.Sources.Said("listen"), cfg.Listen, d.lis.Addr())
		}
		if so.Token == "" {
			log.Warn("listening beyond loopback without a bearer token", zap.String("addr", d.lis.Addr().String()), zap.Bool("tls", cfg.TLSCert != ""), zap.Bool("insecure", cfg.Insecure))
		}
	}
	// The metrics port is bound before the model loads too: a port in
	// use must not cost a teacher's load (minutes for a large one). It
	// answers 503 until the model is loaded.
	var metricsReady atomic.Pointer[http.Handler]
	if cfg.Metrics != "off" {
		if d.mlis, err = net.Listen("tcp", cfg.Metrics); err != nil {
			d.lis.Close()
			return nil, listenError(cfg.Sources.Said("metrics"), cfg.Sources.hint("metrics"), cfg.Metrics, err)
		}
		mux := http.NewServeMux()
		mux.HandleFunc("/metrics", func(w http.ResponseWriter, r *http.Request) {
			h := metricsReady.Load()
			if h == nil {
				http.Error(w, "teacherd is loading the model", http.StatusServiceUnavailable)
				return
			}
			(*h).ServeHTTP(w, r)
		})
		d.metrics = &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
		go d.metrics.Serve(d.mlis)
	}
	d.gs, d.srv = NewGRPCServer(so)
	go d.gs.Serve(d.lis)
	log.Info("listening (loading the model: health NOT_SERVING)", zap.String("addr", d.Addr()), zap.Bool("tls", cfg.TLSCert != ""), zap.Bool("auth", so.Token != ""),
		zap.Strings("data_roots", roots.Dirs()))
	core, err := NewCore(CoreOptions{ModelDir: cfg.Model, Weights: cfg.Weights, TokenizerDir: cfg.Tokenizer, CacheDir: cfg.Cache, Device: cfg.Device, Devices: devices, MicroBatches: cfg.MicroBatches,
		TokenBudget: cfg.TokenBudget, KDefault: cfg.KDefault, KMax: cfg.KMax, MaxDraws: cfg.MaxDraws, QueueSamples: cfg.QueueSamples, QueueTokens: cfg.QueueTokens,
		Logger: log})
	if err != nil {
		d.gs.Stop()
		if d.metrics != nil {
			d.metrics.Close()
		}
		return nil, err
	}
	d.core = core
	if d.metrics != nil {
		h := promhttp.HandlerFor(core.met.reg, promhttp.HandlerOpts{})
		metricsReady.Store(&h)
		log.Info("metrics", zap.String("addr", "http://"+d.MetricsAddr()+"/metrics"))
	}
	d.srv.SetCore(core)
	log.Info("serving", zap.String("addr", d.Addr()))
	return d, nil
}

// Shutdown drains: health goes NOT_SERVING, no new RPCs are accepted,
// open Score streams end with Unavailable once they have answered the
// samples they hold (their clients ask again elsewhere or later), and
// in-flight RPCs get DrainTimeout (or until ctx ends) to finish; then the
// rest are cancelled, which aborts their chunks (nothing partial becomes
// visible), and the batcher and cache are closed.
func (d *Daemon) Shutdown(ctx context.Context) error {
	d.srv.Draining()
	ctx, cancel := context.WithTimeout(ctx, d.cfg.DrainTimeout)
	defer cancel()
	stopped := make(chan struct{})
	go func() { d.gs.GracefulStop(); close(stopped) }()
	select {
	case <-stopped:
		d.log.Info("drained: all in-flight requests finished")
	case <-ctx.Done():
		d.log.Warn("drain timeout: cancelling in-flight requests (their chunks are aborted)")
		d.gs.Stop()
		<-stopped
	}
	var errs []error
	if d.metrics != nil {
		errs = append(errs, d.metrics.Close())
	}
	errs = append(errs, d.core.Close())
	return errors.Join(errs...)
}

// A setting is a value of Config checked alone, before anything is
// read, opened or bound (a bad value used to be found after the weights
// had loaded, or never: a negative max_concurrent lifted the bound, a
// negative queue size took the default): its teacherd flag, its config
// file key, and its check, whose error names the value as said does (the
// flag, or the file's key).
type setting struct {
	flag, key string
	check     func(c *Config, said string) error
}

// settings are the values CheckSetting checks.
var settings = []setting{
	{"device", "device", func(c *Config, said string) error {
		return device.CheckSetting(c.Device, device.Options{Purpose: device.Inference, Setting: said})
	}},
	{"weights", "weights", func(c *Config, said string) error {
		if w := c.Weights; w != "" && w != string(infer.WeightsBF16) && w != string(infer.WeightsFP8) {
			return fmt.Errorf("%s %q: want bf16 or fp8", said, w)
		}
		return nil
	}},
	{"devices", "devices", func(c *Config, said string) error { return device.CheckDevices(c.Devices, said) }},
	{"micro-batches", "micro_batches", func(c *Config, said string) error {
		if c.MicroBatches < 0 {
			return fmt.Errorf("%s %d: want 0 (four a GPU) or more", said, c.MicroBatches)
		}
		return nil
	}},
	{"token-budget", "token_budget", notNegative(func(c *Config) int { return c.TokenBudget }, "8192")},
	{"max-concurrent", "max_concurrent", notNegative(func(c *Config) int { return c.MaxConcurrent }, "64")},
	{"queue-samples", "queue_samples", notNegative(func(c *Config) int { return c.QueueSamples }, "1024")},
	{"queue-tokens", "queue_tokens", notNegative(func(c *Config) int { return c.QueueTokens }, "8 token budgets")},
	{"k-default", "k_default", func(c *Config, said string) error {
		if c.KDefault < 0 {
			return fmt.Errorf("%s %d: want 1 or more, at most k-max (0 or none: the default, min(%d, k-max))", said, c.KDefault, DefaultKDefault)
		}
		return nil
	}},
	{"k-max", "k_max", func(c *Config, said string) error {
		if c.KMax < 0 {
			return fmt.Errorf("%s %d: want 1 or more, at most the teacher's vocab size (0 or none: the default, min(vocab size, %d))", said, c.KMax, maxDefaultKMax)
		}
		return nil
	}},
	{"max-draws", "max_draws", func(c *Config, said string) error {
		if c.MaxDraws < 0 || c.MaxDraws > cache.MaxDraws {
			return fmt.Errorf("%s %d: want 1 to %d draws a position (0 or none: the default, %d)", said, c.MaxDraws, cache.MaxDraws, DefaultMaxDraws)
		}
		return nil
	}},
	{"drain-timeout", "drain_timeout", func(c *Config, said string) error {
		if c.DrainTimeout < 0 {
			return fmt.Errorf("%s %v: want a positive duration, e.g. 30s", said, c.DrainTimeout)
		}
		return nil
	}},
	{"listen", "listen", func(c *Config, said string) error { return checkAddress(said, c.Listen) }},
	{"metrics", "metrics", func(c *Config, said string) error {
		if c.Metrics == "off" {
			return nil
		}
		return checkAddress(said, c.Metrics)
	}},
}

// notNegative is the check of a count whose 0 is the default dflt.
func notNegative(v func(*Config) int, dflt string) func(*Config, string) error {
	return func(c *Config, said string) error {
		if n := v(c); n < 0 {
			return fmt.Errorf("%s %d: want a positive number (0 or none: the default, %s)", said, n, dflt)
		}
		return nil
	}
}

// checkAddress refuses an address net.Listen would refuse for its form
// (not HOST:PORT), with listenError's message, without binding it; ""
// is the default.
func checkAddress(said, addr string) error {
	if addr == "" {
		return nil
	}
	if _, _, err := net.SplitHostPort(addr); err != nil {
		return listenError(said, "", addr, err) // an *AddrError: its message needs no hint
	}
	return nil
}

// CheckSetting checks the value c holds for the setting teacherd's flag
// named flag sets ("weights" for --weights) as far as the value alone
// tells, before anything is read, opened or bound, as Start does: the
// device name and the weight format, the form of --devices and of the
// listen addresses, the counts and bounds. It is nil for a good value,
// and for a setting whose check needs more (a file, the model's
// config.json, the GPUs: Start checks those). Its error (ErrConfig)
// names the setting as c.Sources says it came: as the flag (`--weights
// "fp4": want bf16 or fp8`), or as the key of the config file (`config
// FILE: weights: "fp4": want bf16 or fp8`): teacherd checks the flags
// given before it reads the file, as a usage error, and the file's values
// that no flag overrides after. Settings that must agree with each other
// are CheckPairs'.
func (c *Config) CheckSetting(flag string) error {
	for _, s := range settings {
		if s.flag == flag {
			return errkind.Wrap(ErrConfig, s.check(c, c.Sources.Said(s.flag)))
		}
	}
	return nil
}

// A pair is two settings whose values are each right alone but may
// contradict each other; checked once the flags and the file are merged,
// since either alone may lack the half that makes the other right (a
// --tls-cert flag, the file's tls_key).
type pair struct {
	flags [2]string
	check func(c *Config) error
}

// pairs are the settings CheckPairs checks together.
var pairs = []pair{
	{[2]string{"k-default", "k-max"}, func(c *Config) error {
		s := c.Sources
		switch {
		case c.KDefault <= 0: // 0: the default, at most k-max; below: CheckSetting's
		case c.KMax > 0 && c.KDefault > c.KMax:
			return fmt.Errorf("%s %d: want 1 <= %s <= %d (%s)", s.Said("k-default"), c.KDefault, s.word("k-default"), c.KMax, s.ref("k-max", "k-default"))
		case c.KMax == 0 && c.KDefault > maxDefaultKMax:
			return fmt.Errorf("%s %d: want 1 <= %s <= %d (the default %s, min(vocab size, %d)); give %s too for more",
				s.Said("k-default"), c.KDefault, s.word("k-default"), maxDefaultKMax, s.wordLike("k-max", "k-default"), maxDefaultKMax, s.like("k-max", "k-default"))
		}
		return nil
	}},
	// --devices places stages on GPUs: not with the CPU. Checked on the
	// values, before ParseDevices counts all's GPUs: --device cpu
	// --devices all said the CUDA driver would not load.
	{[2]string{"device", "devices"}, func(c *Config) error {
		s := c.Sources
		spec := strings.TrimSpace(c.Devices)
		if c.Device != "cpu" || spec == "" {
			return nil
		}
		sep := " "
		if s.fromFile("device") || s.fromFile("devices") {
			sep = ", "
		}
		return fmt.Errorf("%s cpu%s%s %s: %s places the teacher's layers on GPUs: use %s cuda (or auto) with it, or leave %s out to run on the CPU",
			s.Said("device"), sep, s.Said("devices"), spec, s.hint("devices"), s.hint("device"), s.hint("devices"))
	}},
	{[2]string{"tls-cert", "tls-key"}, func(c *Config) error {
		s := c.Sources
		switch {
		case c.TLSCert != "" && c.TLSKey == "":
			return fmt.Errorf("%s %s: TLS needs %s too (the certificate's private key, PEM), or neither for no TLS", s.Said("tls-cert"), c.TLSCert, s.like("tls-key", "tls-cert"))
		case c.TLSKey != "" && c.TLSCert == "":
			return fmt.Errorf("%s %s: TLS needs %s too (the key's certificate, PEM), or neither for no TLS", s.Said("tls-key"), c.TLSKey, s.like("tls-cert", "tls-key"))
		}
		return nil
	}},
}

// CheckPairs checks the settings whose values must agree with each other
// as far as the values alone tell (--k-default at most --k-max; no
// --devices with --device cpu; both --tls-cert and --tls-key, or
// neither), as Start does before anything
// is read or bound; that k-max is at most the teacher's vocabulary Start
// checks once it has read config.json. Its error (ErrConfig) names the
// values as c.Sources says they came, and flags are the teacherd flags of
// the pair it is about, for a caller that tells a command line's mistake
// (a usage error) from the config file's.
func (c *Config) CheckPairs() (flags []string, err error) {
	for _, p := range pairs {
		if err := p.check(c); err != nil {
			return p.flags[:], errkind.Wrap(ErrConfig, err)
		}
	}
	return nil, nil
}

// CheckK refuses k bounds the model cannot give, before anything is
// bound or loaded, as NewCore sets and checks them, from the vocabulary
// vocab its config.json gives (they failed once the weights had loaded),
// naming each value as c.Sources says it came. teacherd --plan checks
// them too, so that it never plans a daemon that would refuse to start.
func (c *Config) CheckK(vocab int) error {
	s := c.Sources
	kmax, kdef := c.KMax, c.KDefault
	if kmax == 0 {
		kmax = min(vocab, maxDefaultKMax)
	}
	if kdef == 0 {
		kdef = min(DefaultKDefault, kmax)
	}
	switch {
	case kmax < 1 || kmax > vocab:
		return configErrorf("%s %d: want 1 <= %s <= %d (the teacher's vocab size)", s.Said("k-max"), c.KMax, s.word("k-max"), vocab)
	case kdef < 1 || kdef > kmax:
		bound := s.ref("k-max", "k-default")
		if c.KMax == 0 {
			bound = fmt.Sprintf("the default %s, min(vocab size %d, %d)", s.wordLike("k-max", "k-default"), vocab, maxDefaultKMax)
		}
		return configErrorf("%s %d: want 1 <= %s <= %d (%s)", s.Said("k-default"), c.KDefault, s.word("k-default"), kmax, bound)
	}
	return nil
}

// listenError says which setting's address could not be bound (said:
// Sources.Said), and what to do about it (hint: Sources.hint).
func listenError(said, hint, addr string, err error) error {
	var oe *net.OpError
	if errors.As(err, &oe) {
		err = oe.Err // "bind: address already in use", without the address again
	}
	var ae *net.AddrError
	var de *net.DNSError
	switch {
	case errors.Is(err, syscall.EADDRINUSE):
		return configErrorf("%s %s: %v: another process (another teacherd?) listens there: stop it, or give another %s address", said, addr, err, hint)
	case errors.Is(err, syscall.EACCES):
		return configErrorf("%s %s: %v: ports below 1024 need root (or CAP_NET_BIND_SERVICE): give a port above 1023", said, addr, err)
	case errors.As(err, &de):
		return configErrorf("%s %s: %v: give a host name this machine resolves, or an IP address", said, addr, err)
	case errors.As(err, &ae):
		return configErrorf("%s %s: %v: want HOST:PORT, e.g. 127.0.0.1:7070", said, addr, err)
	}
	return configErrorf("%s %s: %v", said, addr, err)
}

// unwrapPath drops an *os.PathError's operation and path, which the
// message around it names already.
func unwrapPath(err error) error {
	var pe *os.PathError
	if errors.As(err, &pe) {
		return pe.Err
	}
	return err
}
