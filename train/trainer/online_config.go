package trainer

import (
	"fmt"
	"math"
	"strings"
	"time"

	"gopkg.in/yaml.v3"

	"distill/cache"
	"distill/internal/errkind"
	"distill/internal/stall"
)

// OnlineConfig is the part of the distill section that trains against
// live teachers (online KD): the trainer asks teacherd daemons for the
// top-k of every sample through Score instead of reading a cache. It
// needs data.dataset and excludes data.cache.
type OnlineConfig struct {
	// Teachers are the teachers asked; each entry is one teacher, whose
	// addresses are replicas sharing the work. The shorthand
	// `teachers: [host:7070, host2:7070]` is one teacher with these
	// replicas. With several entries (multi-teacher KD) every teacher
	// answers every sample, and the KD term is Σ weight·KD of each, as
	// with data.caches.
	Teachers TeacherList `yaml:"teachers,omitempty"`
	// Prefetch is how many samples are in flight ahead of the step
	// (asked, or answered and waiting to be packed); 0: 64.
	Prefetch int `yaml:"prefetch,omitempty"`
	// WriteCache is a cache directory every answer also goes into, in
	// the normal format, whole chunks only; a later run (and the next
	// epoch) reads the chunks there instead of asking again. With
	// several teachers each has its own cache, WriteCache/<name>: the
	// caches a data.caches run can read.
	WriteCache string `yaml:"write_cache,omitempty"`
	// WriteEncoding is the write cache's log-prob encoding: compact
	// (default, as cachectl fill) or lossless.
	WriteEncoding string `yaml:"write_encoding,omitempty"`
	// ChunkSamples is the samples of a write-cache chunk, and the chunking
	// of the training order (as cachectl fill --chunk; 0: 256): an online
	// run visits the samples in the order an offline run visits a cache
	// filled with these chunks.
	ChunkSamples int64 `yaml:"chunk_samples,omitempty"`
	// K is the top-k entries asked per position (0: the teacher's
	// default), as cachectl fill --k.
	K int `yaml:"k,omitempty"`
	// Samples is N, the draws per position asked of the teachers under
	// distill.targets sampled or head+sampled (as cachectl fill
	// --samples): the teachers draw as a fill does, keyed by the dataset's
	// fingerprint and each sample's index, so the run trains as from a
	// cache of that kind.
	Samples int `yaml:"samples,omitempty"`
	// CaptureTemperature is the temperature the teacher's log-probs are
	// computed at (0: 1), as cachectl fill --temperature.
	CaptureTemperature float64 `yaml:"capture_temperature,omitempty"`
	// TeacherTimeout: when no teacher has been reachable this long, the
	// run checkpoints and exits with an error (0: 10m).
	TeacherTimeout time.Duration `yaml:"teacher_timeout,omitempty"`
	// StallTimeout bounds how long a teacher's Score stream may send
	// nothing, no answer and no progress, while it owes answers: a daemon
	// whose forward pass hangs while it still answers pings (a GPU hang,
	// a deadlock) is then treated as a replica that failed (its samples go
	// to the other replicas; with none, training pauses and, past
	// teacher_timeout, checkpoints and exits). The daemon sends progress
	// while a sample waits or computes, so a slow teacher is no stall;
	// an older teacherd sends none, and the timeout then bounds each
	// answer. Absent: 10m; 0: no limit.
	StallTimeout *Timeout `yaml:"stall_timeout,omitempty"`
	// TokenFile holds the daemons' bearer token (teacherd --token-file);
	// empty: $DISTILL_TOKEN if set, else none.
	TokenFile string `yaml:"token_file,omitempty"`
	// TLSCA is a PEM CA file: connect with TLS, trusting it (as cachectl
	// fill --tls-ca). TLSServerName overrides the name checked.
	TLSCA         string `yaml:"tls_ca,omitempty"`
	TLSServerName string `yaml:"tls_server_name,omitempty"`
}

// TeacherConfig is one teacher of distill.teachers.
type TeacherConfig struct {
	// Addrs are the replicas of this teacher (host:port): they share the
	// work, and a replica that fails has its samples sent to the others.
	Addrs []string `yaml:"addrs"`
	// Name names the teacher in metrics and logs (default t0, t1, ...),
	// and its write cache (distill.write_cache/<name>) with several
	// teachers.
	Name string `yaml:"name,omitempty"`
	// Weight weighs the teacher's KD term (multi-teacher; default 1,
	// must be > 0).
	Weight float64 `yaml:"weight,omitempty"`
}

// TeacherList is distill.teachers: a list of teacher entries, or a list
// of addresses (the replicas of one teacher).
type TeacherList []TeacherConfig

// UnmarshalYAML reads either form.
func (l *TeacherList) UnmarshalYAML(n *yaml.Node) error {
	if n.Kind != yaml.SequenceNode {
		return fmt.Errorf("distill.teachers (line %d): want a list: [host:7070, ...] (the replicas of one teacher) or a list of {addrs: [...], name: ..., weight: ...}", n.Line)
	}
	short := len(n.Content) > 0
	for _, e := range n.Content {
		if e.Kind != yaml.ScalarNode {
			short = false
		}
	}
	if short {
		var t TeacherConfig
		for _, e := range n.Content {
			t.Addrs = append(t.Addrs, e.Value)
		}
		*l = TeacherList{t}
		return nil
	}
	var out []TeacherConfig
	for i, e := range n.Content {
		if e.Kind != yaml.MappingNode {
			return fmt.Errorf("distill.teachers[%d] (line %d): want {addrs: [host:7070, ...], name: ..., weight: ...}; do not mix addresses and entries", i, e.Line)
		}
		var t TeacherConfig
		if err := e.Decode(&t); err != nil {
			return fmt.Errorf("distill.teachers[%d]: %w", i, err)
		}
		// An explicit 0 is no default: it became weight 1 unsaid
		// (withDefaults cannot tell it from a weight left out).
		for k := 0; k+1 < len(e.Content); k += 2 {
			if e.Content[k].Value == "weight" && t.Weight == 0 {
				return fmt.Errorf("distill.teachers[%d].weight (line %d): 0: want a positive weight (default 1); every teacher of distill.teachers is trained on: to leave one out, remove its entry", i, e.Content[k].Line)
			}
		}
		out = append(out, t)
	}
	*l = out
	return nil
}

// Online defaults.
const (
	defaultPrefetch       = 64
	defaultChunkSamples   = 256 // as serve.DefaultChunkSamples: cachectl fill's --chunk
	defaultTeacherTimeout = 10 * time.Minute
)

// withDefaults fills in the online defaults (names t0, t1, ..., weight 1).
func (o *OnlineConfig) withDefaults() {
	for i := range o.Teachers {
		t := &o.Teachers[i]
		if t.Name == "" {
			t.Name = fmt.Sprintf("t%d", i)
		}
		if t.Weight == 0 {
			t.Weight = 1
		}
	}
	if o.Prefetch == 0 {
		o.Prefetch = defaultPrefetch
	}
	if o.ChunkSamples == 0 {
		o.ChunkSamples = defaultChunkSamples
	}
	if o.TeacherTimeout == 0 {
		o.TeacherTimeout = defaultTeacherTimeout
	}
	if o.WriteEncoding == "" {
		o.WriteEncoding = string(cache.EncodingCompact)
	}
	if o.CaptureTemperature == 0 {
		o.CaptureTemperature = 1
	}
}

// stallTimeout is distill.stall_timeout: absent, stall.DefaultTimeout;
// 0, none.
func (o *OnlineConfig) stallTimeout() time.Duration {
	if o.StallTimeout == nil {
		return stall.DefaultTimeout
	}
	return time.Duration(*o.StallTimeout)
}

// Timeout is a duration key that may be a bare 0 (no limit): YAML reads
// `0` as an integer, which a time.Duration refuses ("cannot unmarshal
// !!int"); other values are durations, 10m or 90s.
type Timeout time.Duration

// UnmarshalYAML reads a duration, or 0.
func (d *Timeout) UnmarshalYAML(n *yaml.Node) error {
	if n.Kind == yaml.ScalarNode && n.Tag == "!!int" && n.Value == "0" {
		*d = 0
		return nil
	}
	var v time.Duration
	if err := n.Decode(&v); err != nil {
		return err
	}
	*d = Timeout(v)
	return nil
}

// MarshalYAML writes it as a duration (the run's saved config).
func (d Timeout) MarshalYAML() (any, error) { return time.Duration(d).String(), nil }

// online reports whether the run asks live teachers.
func (c *Config) online() bool { return len(c.Distill.Teachers) > 0 }

// validateOnline checks distill.teachers and its companions, naming the
// key: online KD needs data.dataset and excludes data.cache; teacher
// names are unique and usable as metric keys and directory names.
func (c *Config) validateOnline() error {
	bad := func(key string, format string, a ...any) error {
		return errkind.Errorf(ErrConfig, "%s: %s", key, fmt.Sprintf(format, a...))
	}
	o := &c.Distill.OnlineConfig
	if !c.online() {
		for _, k := range []struct {
			key string
			set bool
		}{
			{"prefetch", o.Prefetch != 0}, {"write_cache", o.WriteCache != ""}, {"write_encoding", o.WriteEncoding != ""}, {"chunk_samples", o.ChunkSamples != 0},
			{"k", o.K != 0}, {"samples", o.Samples != 0}, {"capture_temperature", o.CaptureTemperature != 0}, {"teacher_timeout", o.TeacherTimeout != 0}, {"stall_timeout", o.StallTimeout != nil},
			{"token_file", o.TokenFile != ""}, {"tls_ca", o.TLSCA != ""}, {"tls_server_name", o.TLSServerName != ""},
		} {
			if k.set {
				return bad("distill."+k.key, "is for online KD and needs distill.teachers (the teacherd addresses to ask); set them, or remove distill.%s", k.key)
			}
		}
		return nil
	}
	o.withDefaults()
	switch {
	case len(c.Data.Cache) > 0 || len(c.Data.Caches) > 0:
		return bad("distill.teachers", "online KD asks live teachers and reads no cache: remove data.cache or data.caches (to train from a cache) or distill.teachers (to ask the teachers), and give data.dataset")
	case c.Data.Dataset == nil:
		return bad("distill.teachers", "online KD needs data.dataset: the samples the teachers score (the dataset a cache would be filled from)")
	case o.Prefetch < 0:
		return bad("distill.prefetch", "%d: want > 0 samples in flight ahead of the step (0: %d)", o.Prefetch, defaultPrefetch)
	case o.ChunkSamples < 0:
		return bad("distill.chunk_samples", "%d: want > 0 (0: %d, cachectl fill's default)", o.ChunkSamples, defaultChunkSamples)
	case o.K < 0:
		return bad("distill.k", "%d: want > 0 (0: the teacher's default k)", o.K)
	case !(o.CaptureTemperature > 0) || math.IsInf(o.CaptureTemperature, 0):
		return bad("distill.capture_temperature", "%g: want a positive finite temperature (0: 1)", o.CaptureTemperature)
	case o.TeacherTimeout < 0:
		return bad("distill.teacher_timeout", "%v: want a positive duration such as 10m", o.TeacherTimeout)
	case o.StallTimeout != nil && *o.StallTimeout < 0:
		return bad("distill.stall_timeout", "%v: want a duration >= 0 such as 10m (0: no limit)", time.Duration(*o.StallTimeout))
	case o.WriteEncoding != string(cache.EncodingCompact) && o.WriteEncoding != string(cache.EncodingLossless):
		return bad("distill.write_encoding", "%q: want compact or lossless", o.WriteEncoding)
	}
	if err := c.validateOnlineTargets(); err != nil {
		return err
	}
	seen := map[string]int{}
	for i, t := range o.Teachers {
		key := fmt.Sprintf("distill.teachers[%d].name", i)
		for _, r := range t.Name {
			if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '_' || r == '-' || r == '.') {
				return bad(key, "%q: use letters, digits, '_', '-' and '.' only (it becomes a metrics key and the name of its write cache)", t.Name)
			}
		}
		if t.Name == "." || t.Name == ".." {
			return bad(key, "%q: not a usable name (it names the teacher's write cache directory): give the teacher a name", t.Name)
		}
		if j, ok := seen[t.Name]; ok {
			return bad(key, "%q is also the name of distill.teachers[%d] (a default name is t<index>): give every teacher its own name", t.Name, j)
		}
		seen[t.Name] = i
		if len(t.Addrs) == 0 {
			return bad(fmt.Sprintf("distill.teachers[%d].addrs", i), "empty: give the teacher's teacherd addresses (host:port)")
		}
		for j, a := range t.Addrs {
			if strings.TrimSpace(a) == "" || strings.ContainsAny(a, " ,") {
				return bad(fmt.Sprintf("distill.teachers[%d].addrs[%d]", i, j), "%q: want host:port (one address per list item)", a)
			}
		}
		if !(t.Weight > 0) || math.IsInf(t.Weight, 0) {
			return bad(fmt.Sprintf("distill.teachers[%d].weight", i), "%g: want a positive finite weight (default 1)", t.Weight)
		}
	}
	// One daemon in two entries is one teacher twice: it trained silently
	// at the sum of its weights, its numbers reported twice.
	at := map[string][2]int{} // an address (as compared) -> its teacher and index in addrs
	for i, t := range o.Teachers {
		for j, a := range t.Addrs {
			k := strings.ToLower(strings.TrimSpace(a))
			p, ok := at[k]
			if !ok {
				at[k] = [2]int{i, j}
				continue
			}
			if p[0] == i {
				continue // a replica listed twice: still one teacher at its weight
			}
			q := o.Teachers[p[0]]
			return bad(fmt.Sprintf("distill.teachers[%d].addrs[%d]", i, j), "%s is also distill.teachers[%d].addrs[%d] (%s): the same daemon in two entries trains as one teacher at the sum of its weights; give it once (with weight: %g, the sum of both entries' weights, it trains as now), or correct the address of the teacher you meant (the replicas of one teacher go in one entry's addrs)",
				a, p[0], p[1], q.Name, q.Weight+t.Weight)
		}
	}
	return nil
}

// validateOnlineTargets checks distill.samples and distill.k against
// distill.targets, as cachectl fill checks --samples and --k against
// --targets.
func (c *Config) validateOnlineTargets() error {
	o := &c.Distill.OnlineConfig
	kind, err := cache.ParseTargets(c.Distill.Targets)
	if err != nil {
		return nil // the loss's validation names distill.targets
	}
	switch {
	case kind == cache.TargetsTopK && o.Samples != 0:
		return errkind.Errorf(ErrConfig, "distill.samples %d with distill.targets topk: draws belong to targets sampled or head+sampled; set distill.targets, or remove distill.samples", o.Samples)
	case kind != cache.TargetsTopK && (o.Samples < 1 || o.Samples > cache.MaxDraws):
		return errkind.Errorf(ErrConfig, "distill.samples %d with distill.targets %s: want 1 to %d draws per position asked of the teachers (as cachectl fill --samples; at most the daemons' --max-draws)", o.Samples, kind, cache.MaxDraws)
	case kind == cache.TargetsSampled && o.K != 0:
		return errkind.Errorf(ErrConfig, "distill.k %d with distill.targets sampled: sampled targets have no top-k head; use distill.targets head+sampled for an exact head of k plus draws, or remove distill.k", o.K)
	}
	return nil
}
