package serve

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"go.uber.org/zap"
	"google.golang.org/protobuf/proto"

	"distill/cache"
	"distill/compute"
	"distill/compute/device"
	"distill/data"
	"distill/data/tokenizer"
	"distill/infer"
	"distill/internal/errkind"
	pb "distill/proto/distill/v1"
)

// Defaults of CoreOptions.
const (
	// DefaultChunkSamples is the chunk size of a Fill that gives none.
	DefaultChunkSamples = 256
	// DefaultKDefault is the k of a request that gives none.
	DefaultKDefault = 64
	// DefaultMaxDraws is a daemon's CoreOptions.MaxDraws unless set.
	DefaultMaxDraws = 64
	// DefaultQueueSamples bounds the queued Score samples and fill groups.
	DefaultQueueSamples = 1024
	// maxCachedDatasets bounds the opened datasets a core keeps.
	maxCachedDatasets = 8
	// maxDefaultKMax is a daemon's KMax unless set, for a vocabulary
	// larger: min(vocab, maxDefaultKMax).
	maxDefaultKMax = 4096
)

// CoreOptions configure a Core. ModelDir is required.
type CoreOptions struct {
	// ModelDir is the HF checkpoint directory of the teacher.
	ModelDir string
	// Weights is how the teacher holds its layers' Linear weights: bf16
	// ("" too) or fp8 (infer.LoadOptions: E4M3, quantized at load; a
	// different fingerprint, so its caches are its own).
	Weights string
	// TokenizerDir holds tokenizer.json; empty means ModelDir, where a
	// missing tokenizer.json is allowed (only pre-tokenized data then).
	TokenizerDir string
	// CacheDir is the cache fills write; empty disables Fill.
	CacheDir string
	// Device is auto, cpu or cuda (package compute/device, for inference:
	// auto takes the GPU when its backend opens, else the CPU).
	Device string
	// Devices, when set, are the GPUs (ordinals; one may repeat: stages
	// sharing a GPU) the teacher's layers are split over, a pipeline
	// stage each (infer.LoadStages); Device is then cuda or auto.
	Devices []int
	// MicroBatches cuts each forward of a pipelined teacher into that
	// many micro-batches (of whole samples; 0: four a stage, none of
	// fewer than 1024 tokens).
	MicroBatches int
	// DeviceLogf receives the device chooser's lines (which backend auto
	// took and why, the GPU's kernels); nil sends them to Logger.
	DeviceLogf func(format string, args ...any)
	// TokenBudget is the tokens of one forward pass (default infer.DefaultTokenBudget).
	TokenBudget int
	// KDefault replaces k = 0 (default 64, at most KMax); KMax caps k
	// (default min(vocab, 4096): the cache's format limit; InProcess:
	// min(vocab, 64)). The device-memory check plans for k = KMax.
	KDefault, KMax int
	// MaxDraws is the most draws per position a Fill or Score of sampled
	// targets may ask for (default DefaultMaxDraws; InProcess: none unless
	// set): the device-memory check plans the LM head's draws for it, and
	// a request asking for more is refused.
	MaxDraws int
	// QueueSamples and QueueTokens bound the work queue (defaults 1024
	// samples, 8 token budgets); Score requests beyond get ResourceExhausted.
	QueueSamples, QueueTokens int
	// FillChunksInFlight is the chunks one Fill works on at once (default
	// 2: one tokenizes or commits while the other computes).
	FillChunksInFlight int
	// ProgressEvery is the least time between two progress messages of
	// one Score stream or Fill (0: DefaultProgressEvery). Clients' stall
	// timeouts must be well above it.
	ProgressEvery time.Duration
	// Logger receives structured logs; nil means zap.NewNop.
	Logger *zap.Logger
	// InProcess says the core is the teacher of `cachectl fill --model`
	// in this process, not a daemon's: its errors speak to that user.
	InProcess bool
}

// Core is the daemon without its transport: the loaded teacher, the
// batcher that packs all work into forward passes, the dataset and cache
// handling of fills. The gRPC server and `cachectl fill --model` (the
// in-process teacher) both drive it.
type Core struct {
	opt     CoreOptions
	model   *infer.Model
	tok     *tokenizer.Tokenizer // nil: pre-tokenized data only
	lim     Limits
	budget  int
	b       *batcher
	met     *metrics
	log     *zap.Logger
	started time.Time
	// progEvery is opt.ProgressEvery (tests of daemons change it).
	progEvery atomic.Int64

	dsMu     sync.Mutex
	datasets map[string]*openDataset
	dsUses   uint64 // bumped on every use: the least recently used is evicted

	cacheMu sync.Mutex
	cw      *cache.Cache

	flightMu sync.Mutex
	inflight map[cache.Range]int
}

// openDataset is a dataset the core keeps open, with the calls using it.
// An evicted dataset is closed when its last user releases it.
type openDataset struct {
	d       *data.Dataset
	refs    int
	lastUse uint64
	evicted bool
}

// checkCacheDir refuses a cache path that cannot be a directory, or that
// this process cannot write, so that the daemon fails at startup rather
// than at its first Fill (a read-only cache answered every Fill with an
// internal error, after the teacher had loaded). A missing directory is
// fine when the nearest directory above it that exists is writable: the
// first fill creates it there. Its errors name the path as src says it
// came (the zero Sources: --cache). inProcess is a cachectl fill's own
// teacher, which needs its cache: the daemon's way out, to start without
// one and serve Score only, is not a fill's.
func checkCacheDir(dir string, src Sources, inProcess bool) error {
	said, hint := src.Said("cache"), src.hint("cache")
	if dir == "" {
		return nil
	}
	st, err := os.Stat(dir)
	probe := dir
	switch {
	case errors.Is(err, os.ErrNotExist) || errors.Is(err, syscall.ENOTDIR):
		// The first fill's MkdirAll creates dir below its nearest existing
		// ancestor: that is the directory that must be writable.
		for probe = filepath.Dir(dir); ; probe = filepath.Dir(probe) {
			st, err := os.Stat(probe)
			if err == nil && !st.IsDir() {
				return configErrorf("%s %s: %s is a file, not a directory: give a cache path under a directory", said, dir, probe)
			}
			if err == nil || probe == filepath.Dir(probe) {
				break
			}
		}
	case err != nil:
		return configErrorf("%s %s: %v", said, dir, err)
	case !st.IsDir():
		return configErrorf("%s %s is a file, not a directory: give a directory (a missing one is created at the first fill)", said, dir)
	}
	// Writing a file is the only sure test: permissions, a read-only
	// mount, an immutable directory and root's exemptions all decide it.
	f, err := os.CreateTemp(probe, ".write-probe-*")
	if err != nil {
		err = unwrapPath(err) // the probe's own name means nothing to the user
		where := "it"
		if probe != dir {
			where = "the directory it would be created in, " + probe + ","
		}
		if inProcess {
			return configErrorf("%s %s: %s is not writable (%v): the fill writes the cache, so give a directory this process can write",
				said, dir, where, err)
		}
		return configErrorf("%s %s: %s is not writable (%v): fills write the cache, so give a directory this process can write, or start without %s to serve Score only",
			said, dir, where, err, hint)
	}
	f.Close()
	os.Remove(f.Name())
	return nil
}

// NewCore loads the teacher (and tokenizer) and starts the batcher.
func NewCore(o CoreOptions) (*Core, error) {
	if o.Logger == nil {
		o.Logger = zap.NewNop()
	}
	if o.DeviceLogf == nil {
		o.DeviceLogf = o.Logger.Sugar().Infof
	}
	bes, err := openBackends(o)
	if err != nil {
		return nil, errkind.Wrap(ErrConfig, err)
	}
	o.Device = bes[0].Name()
	if o.ModelDir == "" {
		return nil, configErrorf("no model directory: give --model DIR (an HF checkpoint)")
	}
	if err := checkCacheDir(o.CacheDir, Sources{}, o.InProcess); err != nil {
		return nil, err
	}
	if o.TokenBudget == 0 {
		o.TokenBudget = infer.DefaultTokenBudget
	}
	if o.TokenBudget < 1 {
		return nil, configErrorf("token budget %d must be positive", o.TokenBudget)
	}
	if o.FillChunksInFlight <= 0 {
		o.FillChunksInFlight = 2
	}
	if o.QueueSamples <= 0 {
		o.QueueSamples = DefaultQueueSamples
	}
	if o.QueueTokens <= 0 {
		o.QueueTokens = 8 * o.TokenBudget
	}
	t0 := time.Now()
	so := infer.LoadOptions{Weights: infer.WeightFormat(o.Weights), MicroBatches: o.MicroBatches}
	if o.MicroBatches > 0 {
		so.MinMicroTokens = 1 // as many as asked
	}
	m, err := infer.LoadStages(o.ModelDir, bes, so)
	if err != nil {
		if fe := (*infer.FitError)(nil); errors.As(err, &fe) {
			return nil, doesNotFit(o, fe, err)
		}
		return nil, loadError(o.ModelDir, err)
	}
	V := m.Cfg.VocabSize
	if o.KMax == 0 {
		o.KMax = min(V, maxDefaultKMax)
		if o.InProcess {
			// cachectl fill's own teacher serves that fill's k only
			// (CoreOptions.KMax, when it gives one); a daemon's serves
			// any client up to 4096, and plans its memory for that.
			o.KMax = min(V, DefaultKDefault)
		}
	}
	if o.KDefault == 0 {
		o.KDefault = min(DefaultKDefault, o.KMax)
	}
	if o.MaxDraws == 0 && !o.InProcess {
		o.MaxDraws = DefaultMaxDraws
	}
	if o.MaxDraws < 0 || o.MaxDraws > cache.MaxDraws {
		return nil, errkind.Errorf(ErrInvalid, "max draws %d: want 0 to %d (cache.MaxDraws)", o.MaxDraws, cache.MaxDraws)
	}
	if err := checkK(o, V); err != nil {
		return nil, err
	}
	c := &Core{opt: o, model: m, budget: o.TokenBudget, met: newMetrics(), log: o.Logger, started: time.Now(),
		datasets: map[string]*openDataset{}, inflight: map[cache.Range]int{}}
	if o.ProgressEvery <= 0 {
		o.ProgressEvery = DefaultProgressEvery
	}
	c.progEvery.Store(int64(o.ProgressEvery))
	c.lim = Limits{VocabSize: V, MaxLen: min(m.Cfg.MaxPositions, o.TokenBudget), KDefault: o.KDefault, KMax: o.KMax, MaxDraws: o.MaxDraws}
	if err := m.CheckDeviceFit(o.TokenBudget, c.lim.MaxLen, o.KMax, o.MaxDraws); err != nil {
		if fe := (*infer.FitError)(nil); errors.As(err, &fe) {
			return nil, doesNotFit(o, fe, err)
		}
		return nil, configErrorf("the teacher %s on %s: %w", o.ModelDir, o.Device, err)
	}
	tdir := o.TokenizerDir
	if tdir == "" {
		tdir = o.ModelDir
	}
	if _, err := os.Stat(filepath.Join(tdir, "tokenizer.json")); err == nil || o.TokenizerDir != "" {
		if c.tok, err = tokenizer.Load(tdir); err != nil {
			return nil, errkind.Errorf(ErrPrecondition, "tokenizer %s: %v", tdir, err)
		}
		if c.tok.VocabSize() > V {
			return nil, errkind.Errorf(ErrPrecondition, "the tokenizer in %s has %d tokens but the model in %s has vocab_size %d: its ids would be out of range; use the model's own tokenizer (--tokenizer)",
				tdir, c.tok.VocabSize(), o.ModelDir, V)
		}
	}
	var start startFunc
	if m.InFlight() > 1 { // a pipeline: a forward a stage in flight
		start = func(samples [][]int32, k int, temp float32, d *infer.Draws) func() ([]int32, []float32, infer.DrawResult) {
			if d != nil {
				return m.StartForwardDraws(samples, k, temp, *d)
			}
			wait := m.StartForward(samples, k, temp)
			return func() ([]int32, []float32, infer.DrawResult) {
				ids, lps := wait()
				return ids, lps, infer.DrawResult{}
			}
		}
	}
	c.b = newPipelinedBatcher(m.Forward, start, m.InFlight(), o.TokenBudget, o.QueueSamples, o.QueueTokens, c.met, m.ForwardDraws)
	c.b.log = o.Logger
	c.log.Info("teacher loaded", zap.String("model", o.ModelDir), zap.String("weights", cmp.Or(o.Weights, "bf16")), zap.String("device", o.Device), zap.String("arch", string(m.Cfg.Arch)),
		zap.Int("vocab", V), zap.Int64("params", m.Cfg.Params()), zap.String("fingerprint", m.Fingerprint()),
		zap.Bool("tokenizer", c.tok != nil), zap.Duration("took", time.Since(t0)))
	if len(bes) > 1 {
		for i, st := range m.Stages() {
			c.log.Info("pipeline stage", zap.Int("stage", i), zap.String("device", compute.DeviceName(bes[i])), zap.String("holds", st.What()))
		}
	}
	c.warnForeignCache()
	return c, nil
}

// warnForeignCache says at start, once the teacher's fingerprint is
// known, when the cache directory holds another teacher's committed
// chunks: every Fill will be refused (Score works). It showed only at the first Fill,
// after the client had planned its run.
func (c *Core) warnForeignCache() {
	if c.opt.CacheDir == "" {
		return
	}
	r, err := cache.OpenReader(c.opt.CacheDir)
	if err != nil {
		return // no cache there yet, or not one: a Fill says so
	}
	m := r.Manifest()
	// A cache with no committed chunk takes the next Fill's manifest.
	if fp := c.model.Fingerprint(); m.TeacherFingerprint != fp && len(r.Chunks()) > 0 {
		c.log.Warn("the cache directory holds another teacher's fill: Fill will refuse it (Score works); "+c.anotherCache(),
			zap.String("cache", c.opt.CacheDir), zap.String("cache_teacher", m.TeacherFingerprint), zap.String("teacher", fp))
	}
}

// doesNotFit is the error of a teacher that does not fit its GPUs (err,
// whose *infer.FitError is fe): what does not fit, on which GPU, and what
// to do in the flags of the command that started it (teacherd's, or
// cachectl fill --model's when o.InProcess). It is a configuration error,
// not a request's: no request was made.
func doesNotFit(o CoreOptions, fe *infer.FitError, err error) error {
	say := func(daemon, inProcess string) string {
		if o.InProcess {
			return inProcess
		}
		return daemon
	}
	var fix string
	if fe.Weights {
		gpus := max(2, len(o.Devices)+1) // one GPU more than it has now
		ords := make([]string, gpus)
		for i := range ords {
			ords[i] = fmt.Sprint(i)
		}
		ways := []string{"spread its layers over several GPUs (--devices " + strings.Join(ords, ",") + ")"}
		if fe.Piped {
			ways[0] = "spread its layers over more GPUs (--devices " + strings.Join(ords, ",") + ")"
		}
		fp8 := o.Weights == string(infer.WeightsFP8)
		if !fp8 {
			ways = append(ways, "load its layers' Linear weights in FP8 ("+say("--weights fp8", "--teacher-weights fp8")+": a byte a weight instead of two, a teacher of another fingerprint)")
		}
		if fe.Piped {
			ways = append(ways, "use GPUs with more memory")
		} else {
			ways = append(ways, "use a GPU with more memory (or --device cpu)")
		}
		plan := say(fmt.Sprintf("teacherd --plan --model %s --devices %s", o.ModelDir, strings.Join(ords, ",")),
			fmt.Sprintf("cachectl plan --config %s --devices %d", filepath.Join(o.ModelDir, "config.json"), gpus))
		note := " (add --weights fp8 for FP8)"
		if fp8 {
			plan, note = plan+" --weights fp8", ""
		}
		fix = fmt.Sprintf("%s, or %s; `%s`%s prints how its layers split over the GPUs and each GPU's bytes, from config.json alone",
			strings.Join(ways[:len(ways)-1], ", "), ways[len(ways)-1], plan, note)
	} else {
		fix = fmt.Sprintf("lower --token-budget to %d or less%s", fe.Budget,
			say(" (or lower --k-max or --max-draws, which the check plans for)", " (or a smaller --k or --samples, which the check plans for)"))
	}
	return errkind.Reword(ErrConfig, err, "the teacher %s does not fit %s: %s: %s", o.ModelDir, fe.Device, fe.What, fix)
}

// openBackends opens the teacher's backend (o.Device), or one per GPU of
// o.Devices.
func openBackends(o CoreOptions) ([]compute.Backend, error) {
	do := device.Options{Purpose: device.Inference, Logf: o.DeviceLogf}
	if len(o.Devices) > 0 {
		return device.OpenStages(o.Device, o.Devices, do)
	}
	be, err := device.Open(o.Device, do)
	if err != nil {
		return nil, err
	}
	return []compute.Backend{be}, nil
}

// Close stops the batcher (queued work fails with ErrShutdown, the forward
// in progress finishes) and releases the cache and datasets.
func (c *Core) Close() error {
	c.b.close()
	c.dsMu.Lock()
	for k, od := range c.datasets {
		c.evict(k, od)
	}
	c.dsMu.Unlock()
	c.cacheMu.Lock()
	defer c.cacheMu.Unlock()
	if c.cw != nil {
		err := c.cw.Close()
		c.cw = nil
		return err
	}
	return nil
}

// Model returns the loaded teacher.
func (c *Core) Model() *infer.Model { return c.model }

// Limits returns what requests are validated against.
func (c *Core) Limits() Limits { return c.lim }

// Info describes the daemon.
func (c *Core) Info() *pb.InfoResponse {
	cfg := c.model.Cfg
	r := &pb.InfoResponse{Architecture: string(cfg.Arch), VocabSize: int32(cfg.VocabSize), TeacherFingerprint: c.model.Fingerprint(),
		MaxPositions: int32(cfg.MaxPositions), Device: c.opt.Device, KDefault: int32(c.lim.KDefault), KMax: int32(c.lim.KMax),
		TokenBudget: int32(c.budget), CacheDir: c.opt.CacheDir, Params: cfg.Params(), ModelDir: c.opt.ModelDir, MaxDraws: int32(c.opt.MaxDraws)}
	if c.tok != nil {
		r.TokenizerFingerprint, r.TokenizerVocabSize = c.tok.Fingerprint(), int32(c.tok.VocabSize())
	}
	return r
}

// submitScore validates r and queues it, failing with ErrOverloaded when
// the queue is full.
// prog, when not nil, hears when the queue moves while r waits.
func (c *Core) submitScore(ctx context.Context, r *pb.ScoreRequest, prog *progress) (*job, error) {
	if err := ValidateScore(r, c.lim); err != nil {
		return nil, err
	}
	k, temp := c.defaults(r.K, r.GetTemperature())
	kind, _ := cache.ParseTargets(r.GetTargets()) // validated
	if kind == cache.TargetsSampled {
		k = 0 // no head
	}
	j := newJob(ctx, [][]int32{r.GetTokens()}, k, temp, false)
	j.prog = prog
	if kind != cache.TargetsTopK {
		// Keyed as a fill's draws (fillChunk), so that the Score of
		// sample i draws what a Fill stores for it.
		key, index := cache.DrawKey(r.GetDatasetFingerprint()), r.GetSampleIndex()
		j.draws = &infer.Draws{N: int(r.GetSamples()), Head: kind == cache.TargetsHeadSampled,
			U: func(_, t, d int) float64 { return cache.DrawUniform(key, index, t, d) }}
	}
	if err := c.b.trySubmit(j); err != nil {
		return nil, err
	}
	return j, nil
}

func (c *Core) defaults(kp *int32, temp float32) (int, float32) {
	k := int32(c.lim.KDefault)
	if kp != nil {
		k = *kp
	}
	if temp == 0 {
		temp = 1
	}
	return int(k), temp
}

// idsOnly is the data.Tokenizer of pre-tokenized datasets: no text can be
// encoded, so package data takes only input_ids records (one with text
// instead is a bad record: an error, or skipped with skip_bad, as in
// training; text beside the ids is not read) and checks the ids against
// the model's vocabulary.
func idsOnly(vocab int) data.IDsOnly { return data.IDsOnly{Vocab: vocab} }

// dataset opens (or returns the already opened) dataset of spec, and a
// func the caller calls once done with it. The core keeps at most
// maxCachedDatasets open; beyond, the least recently used is forgotten,
// and its files are closed as soon as no call uses it.
func (c *Core) dataset(spec *pb.Dataset) (*data.Dataset, func(), error) {
	if err := ValidateDataset(spec); err != nil {
		return nil, nil, err
	}
	key, err := proto.MarshalOptions{Deterministic: true}.Marshal(spec)
	if err != nil {
		return nil, nil, errkind.Errorf(ErrInvalid, "dataset spec: %v", err)
	}
	c.dsMu.Lock()
	defer c.dsMu.Unlock()
	if od, ok := c.datasets[string(key)]; ok {
		return od.d, c.use(od), nil
	}
	var srcs []data.Source
	for i, s := range spec.GetSources() {
		if _, err := os.Stat(s.GetPath()); err != nil {
			if errors.Is(err, os.ErrNotExist) {
				return nil, nil, errkind.Errorf(ErrNotFound, "dataset source %d: %s does not exist%s", i, s.GetPath(), c.say(" on the daemon's machine (paths are the daemon's, not the client's)", ""))
			}
			return nil, nil, errkind.Errorf(ErrPrecondition, "dataset source %d: %v", i, err)
		}
		srcs = append(srcs, data.Source{Path: s.GetPath(), Weight: s.GetWeight(), Format: s.GetFormat(), Columns: columnMap(s.GetColumns())})
	}
	opts := data.Options{MaxLen: int(spec.GetMaxLen()), Policy: data.Policy(spec.GetPolicy()), SkipBad: spec.GetSkipBad(), NumSamples: spec.GetNumSamples(),
		Shuffle: spec.GetShuffle(), Seed: spec.GetSeed(), NoEOS: spec.GetNoEos(), ChatTemplate: spec.GetChatTemplate()}
	if v := spec.GetTemplateVarsJson(); v != "" {
		if err := json.Unmarshal([]byte(v), &opts.TemplateVars); err != nil {
			return nil, nil, errkind.Errorf(ErrInvalid, "template_vars_json: %v", err)
		}
	}
	var tok data.Tokenizer = idsOnly(c.model.Cfg.VocabSize)
	if !spec.GetPretokenized() {
		if c.tok == nil {
			return nil, nil, errkind.Errorf(ErrPrecondition, "the dataset is not marked pre-tokenized but %s", c.say(
				"the daemon has no tokenizer: start it with --tokenizer DIR, or mark the dataset pre-tokenized (input_ids records)",
				"the model directory has no tokenizer.json: give --tokenizer DIR, or --pretokenized for input_ids records"))
		}
		tok = c.tok
	}
	d, err := data.Open(srcs, tok, opts)
	if err != nil {
		return nil, nil, err
	}
	if len(c.datasets) >= maxCachedDatasets {
		lk, lru := "", (*openDataset)(nil)
		for k, od := range c.datasets {
			if lru == nil || od.lastUse < lru.lastUse {
				lk, lru = k, od
			}
		}
		c.evict(lk, lru)
	}
	od := &openDataset{d: d}
	c.datasets[string(key)] = od
	return d, c.use(od), nil
}

// use counts a user of od (under dsMu) and returns its release.
func (c *Core) use(od *openDataset) func() {
	c.dsUses++
	od.lastUse = c.dsUses
	od.refs++
	var once sync.Once
	return func() {
		once.Do(func() {
			c.dsMu.Lock()
			defer c.dsMu.Unlock()
			od.refs--
			if od.evicted && od.refs == 0 {
				od.d.Close()
			}
		})
	}
}

// evict forgets the dataset under key (under dsMu); its files are closed
// now, or by the release of its last user.
func (c *Core) evict(key string, od *openDataset) {
	delete(c.datasets, key)
	od.evicted = true
	if od.refs == 0 {
		od.d.Close()
	}
}

// DescribeDataset opens spec and reports its length and fingerprints.
func (c *Core) DescribeDataset(spec *pb.Dataset) (*pb.DescribeDatasetResponse, error) {
	d, release, err := c.dataset(spec)
	if err != nil {
		return nil, err
	}
	defer release()
	tfp := idsOnly(c.model.Cfg.VocabSize).Fingerprint()
	if !spec.GetPretokenized() {
		tfp = c.tok.Fingerprint()
	}
	return &pb.DescribeDatasetResponse{Samples: d.Len(), Fingerprint: d.Fingerprint(), TokenizerFingerprint: tfp}, nil
}

// checkK checks the core's k settings against the vocabulary V, naming
// the flag the user gave: cachectl fill --k (in-process), or teacherd's
// --k-default and --k-max.
func checkK(o CoreOptions, V int) error {
	if o.InProcess {
		if o.KMax < 1 || o.KMax > V || o.KDefault > o.KMax {
			return configErrorf("--k %d: want 1 <= k <= %d (the teacher's vocab size), or 0 for the default %d", o.KMax, V, min(V, DefaultKDefault))
		}
		return nil
	}
	switch {
	case o.KMax < 1 || o.KMax > V:
		return configErrorf("--k-max %d: want 1 <= k-max <= %d (the teacher's vocab size)", o.KMax, V)
	case o.KDefault < 1 || o.KDefault > o.KMax:
		return configErrorf("--k-default %d: want 1 <= k-default <= %d (k-max)", o.KDefault, o.KMax)
	}
	return nil
}

// loadError is the error of the teacher in dir whose weights did not
// load (for a reason other than memory: doesNotFit), naming dir once.
// err often names it already: first ("DIR: checkpoint does not match
// config.json: ...": "loading teacher " goes in front of it), or inside
// ("no model.safetensors ... in DIR", "DIR/model.safetensors: truncated":
// "loading teacher: "); "loading teacher DIR: " in front of those said
// the path twice.
func loadError(dir string, err error) error {
	msg := err.Error()
	switch {
	case strings.HasPrefix(msg, dir+": "):
		return fmt.Errorf("loading teacher %w", err)
	case namesPath(msg, dir) || namesPath(msg, filepath.Clean(dir)):
		return fmt.Errorf("loading teacher: %w", err)
	}
	return fmt.Errorf("loading teacher %s: %w", dir, err)
}

// namesPath reports whether msg names the path p: p as a word of its
// own, or a path's first part (p followed by '/').
func namesPath(msg, p string) bool {
	for i := 0; p != ""; {
		j := strings.Index(msg[i:], p)
		if j < 0 {
			return false
		}
		j += i
		end := j + len(p)
		if (j == 0 || strings.ContainsRune(" (\"'", rune(msg[j-1]))) && (end == len(msg) || strings.ContainsRune(" :/,;)\"'", rune(msg[end]))) {
			return true
		}
		i = j + 1
	}
	return false
}

// anotherCache is the fix for a fill that does not match the cache
// directory: a daemon writes only the directory it was started with.
func (c *Core) anotherCache() string {
	return c.say("start a teacherd with another --cache directory for this fill (or give its --cache to `cachectl reset --force` to discard the cache)",
		"give another --cache directory")
}

// openCache returns a handle on the daemon's cache that fills under m,
// creating the cache with m or checking that the existing one agrees with
// m. A cache with no committed chunk takes m (cache.Cache.Use), so a
// request that failed before its first commit does not lock the daemon's
// cache to its dataset.
func (c *Core) openCache(m cache.Manifest) (*cache.Cache, error) {
	c.cacheMu.Lock()
	defer c.cacheMu.Unlock()
	if c.opt.CacheDir == "" {
		return nil, errkind.Errorf(ErrPrecondition, "%s --cache DIR to fill", c.say("this daemon has no cache directory: start it with", "no cache directory: give"))
	}
	if c.cw == nil {
		cw, err := cache.Create(c.opt.CacheDir, m, nil)
		if err != nil {
			if errors.Is(err, cache.ErrManifestMismatch) {
				return nil, fmt.Errorf("%w; the cache directory holds another fill (dataset, teacher, k, temperature or encoding): %s", err, c.anotherCache())
			}
			return nil, err
		}
		c.cw = cw
		return cw, nil
	}
	cw, err := c.cw.Use(m)
	if err != nil {
		if errors.Is(err, cache.ErrManifestMismatch) {
			return nil, fmt.Errorf("%w; the cache directory holds another fill: %s", err, c.anotherCache())
		}
		return nil, err
	}
	return cw, nil
}

// existingCache opens the cache directory if it holds a cache (Status
// after a restart), or returns nil.
func (c *Core) existingCache() *cache.Cache {
	c.cacheMu.Lock()
	defer c.cacheMu.Unlock()
	if c.cw == nil && c.opt.CacheDir != "" {
		if cw, err := cache.Open(c.opt.CacheDir, nil); err == nil {
			c.cw = cw
		}
	}
	return c.cw
}

// Status reports work in flight, throughput and done ranges.
func (c *Core) Status(r *pb.StatusRequest) (*pb.StatusResponse, error) {
	jobs, _ := c.b.depth()
	out := &pb.StatusResponse{TokensTotal: c.met.nTokens.Load(), TokensPerSecond: c.met.rate(), QueueDepth: int32(jobs),
		ForwardsTotal: c.met.nForwards.Load(), UptimeSeconds: time.Since(c.started).Seconds(), CacheDir: c.opt.CacheDir}
	c.flightMu.Lock()
	for rg := range c.inflight {
		out.InFlight = append(out.InFlight, &pb.Range{Start: rg.Start, End: rg.End})
	}
	c.flightMu.Unlock()
	sort.Slice(out.InFlight, func(i, j int) bool { return out.InFlight[i].Start < out.InFlight[j].Start })
	if fp := r.GetDatasetFingerprint(); fp != "" {
		if cw := c.existingCache(); cw != nil {
			m, rs, err := cw.Current() // the index's manifest: a fill may have replaced an empty cache's
			if err != nil {
				return nil, err
			}
			if m.DatasetFingerprint == fp {
				out.DatasetKnown = true
				for _, ch := range rs {
					out.Done = append(out.Done, &pb.Range{Start: ch.Start, End: ch.End})
				}
			}
		}
	}
	return out, nil
}

func (c *Core) flight(r cache.Range, d int) {
	c.flightMu.Lock()
	c.inflight[r] += d
	if c.inflight[r] <= 0 {
		delete(c.inflight, r)
	}
	c.flightMu.Unlock()
}

// Fill computes samples [start, end) of the dataset into the cache, chunk
// by chunk (FillChunksInFlight at once), calling emit once per chunk (never
// concurrently). Done chunks are reported as skipped. On error or
// cancellation the chunks in flight are aborted: nothing partial is
// visible.
func (c *Core) Fill(ctx context.Context, r *pb.FillRequest, emit func(*pb.FillResponse) error) error {
	if err := ValidateFill(r, c.lim); err != nil {
		return err
	}
	d, release, err := c.dataset(r.GetDataset())
	if err != nil {
		return err
	}
	defer release()
	f, err := c.newFill(r, d, emit)
	if err != nil {
		return err
	}
	todo, err := f.plan(cache.Range{Start: r.GetStart(), End: r.GetEnd()})
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	f.cancel = cancel
	if r.GetProgress() {
		f.prog = newProgress()
		stop := f.relay(ctx)
		defer stop()
	}
	var wg sync.WaitGroup
	next := make(chan cache.Range)
	for w := 0; w < min(c.opt.FillChunksInFlight, len(todo)); w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for rg := range next {
				f.fillPlanned(ctx, rg)
			}
		}()
	}
feed:
	for _, rg := range todo {
		select {
		case next <- rg:
		case <-ctx.Done():
			break feed
		}
	}
	close(next)
	wg.Wait()
	return f.result(ctx)
}

// fillRun is one Fill as its workers share it: the dataset and cache it
// fills, the targets it computes, and what its chunks came to.
type fillRun struct {
	c     *Core
	d     *data.Dataset
	cw    *cache.Cache
	k     int
	temp  float32
	kind  cache.Targets
	draws int
	size  int64 // samples of a planned chunk
	emit  func(*pb.FillResponse) error

	emitMu sync.Mutex // serializes emit
	cancel func()     // stops the fill at its first error
	// prog, when the client asked for progress messages, hears that the
	// fill's forward groups complete, or that the queue they wait in
	// moves (relay sends it on).
	prog *progress

	mu   sync.Mutex
	err  error   // the first error: the fill's
	busy []error // chunks another writer is computing (cache.ErrRangeBusy)
}

// newFill checks r against the dataset d as this core reads it and opens
// the cache whose manifest the request implies: a fill that cannot be
// done fails before it plans anything.
func (c *Core) newFill(r *pb.FillRequest, d *data.Dataset, emit func(*pb.FillResponse) error) (*fillRun, error) {
	if exp := r.GetExpectDatasetFingerprint(); exp != "" && exp != d.Fingerprint() {
		return nil, errkind.Errorf(ErrPrecondition, "the dataset as %s reads it has fingerprint %.16s, the client expects %.16s: its files, tokenizer or options differ", c.say("this daemon", "the teacher"), d.Fingerprint(), exp)
	}
	if r.GetEnd() > d.Len() {
		return nil, errkind.Errorf(ErrOutOfRange, "range [%d, %d) goes beyond the dataset's %d samples (valid: [0, %d))", r.GetStart(), r.GetEnd(), d.Len(), d.Len())
	}
	k, temp := c.defaults(r.K, r.GetTemperature())
	enc := cache.Encoding(r.GetEncoding())
	if enc == "" {
		enc = cache.EncodingCompact
	}
	tfp := idsOnly(c.model.Cfg.VocabSize).Fingerprint()
	if !r.GetDataset().GetPretokenized() {
		tfp = c.tok.Fingerprint()
	}
	kind, _ := cache.ParseTargets(r.GetTargets()) // validated
	draws := int(r.GetSamples())
	if draws > c.opt.MaxDraws {
		return nil, errkind.Errorf(ErrInvalid, "samples %d: %s plans its device memory for at most %d draws per position (teacherd --max-draws or config max_draws sets it)", draws, c.say("this daemon", "the teacher"), c.opt.MaxDraws)
	}
	if kind == cache.TargetsSampled {
		k = 0 // no head
	}
	cw, err := c.openCache(cache.Manifest{TeacherFingerprint: c.model.Fingerprint(), TokenizerFingerprint: tfp,
		DatasetFingerprint: d.Fingerprint(), VocabSize: c.model.Cfg.VocabSize, K: k, Temperature: temp, Samples: d.Len(), Encoding: enc,
		Targets: kind, Draws: draws})
	if err != nil {
		return nil, err
	}
	size := r.GetChunkSamples()
	if size == 0 {
		size = DefaultChunkSamples
	}
	return &fillRun{c: c, d: d, cw: cw, k: k, temp: temp, kind: kind, draws: draws, size: size, emit: emit}, nil
}

// plan reads the cache's index once, reports the chunks of want that are
// done as skipped, and splits what is left of want into chunks of f.size.
func (f *fillRun) plan(want cache.Range) ([]cache.Range, error) {
	done, err := f.cw.Chunks()
	if err != nil {
		return nil, err
	}
	if testHookFillRead != nil {
		testHookFillRead(f.c)
	}
	for _, ch := range done {
		if ch.Start < want.End && ch.End > want.Start {
			f.c.met.chunks.WithLabelValues("skipped").Inc()
			if err := f.send(&pb.FillResponse{Start: ch.Start, End: ch.End, Skipped: true, Tokens: 0}); err != nil {
				return nil, err
			}
		}
	}
	// What is done and what is left come from the one read of the index
	// above: a chunk another writer committed between two reads was in
	// neither, and the fill then said nothing of it (a client waiting for
	// it as busy never heard that it was done). Left, it is begun, found
	// done and reported skipped.
	var todo []cache.Range
	for _, g := range cache.MissingOf(done, want) {
		for a := g.Start; a < g.End; a += f.size {
			todo = append(todo, cache.Range{Start: a, End: min(a+f.size, g.End)})
		}
	}
	return todo, nil
}

// fillPlanned computes and commits rg, one chunk of the plan, and deals
// with how that ended. The plan is as old as its read of the index, and
// other writers fill the same cache meanwhile, so two outcomes are no
// failure: another writer committed a chunk of other bounds inside rg
// (cache.OverlapError), and then the parts of rg still missing are filled
// instead, on that chunk's boundaries; or another writer is computing an
// overlapping range now (cache.ErrRangeBusy, a *cache.BusyError), and
// then rg is left to it and kept for the fill's error, on which the
// caller tries it again later. A chunk committed or found done is counted
// and sent to the client; any other error fails the whole fill.
func (f *fillRun) fillPlanned(ctx context.Context, rg cache.Range) {
	pieces := []cache.Range{rg}
	for len(pieces) > 0 {
		rg := pieces[0]
		pieces = pieces[1:]
		var st data.Stats
		_, skipped, err := f.c.fillChunk(ctx, f.cw, f.d, rg, f.k, f.temp, f.kind, f.draws, &st, f.prog)
		var oe *cache.OverlapError
		if errors.As(err, &oe) {
			miss, merr := f.cw.Missing(rg.Start, rg.End)
			if merr != nil {
				f.fail(merr)
				return
			}
			pieces = append(miss, pieces...)
			continue
		}
		if errors.Is(err, cache.ErrRangeBusy) {
			f.c.met.chunks.WithLabelValues("busy").Inc()
			f.mu.Lock()
			f.busy = append(f.busy, err)
			f.mu.Unlock()
			continue
		}
		if err != nil {
			f.c.met.chunks.WithLabelValues("failed").Inc()
			f.fail(err)
			return
		}
		outcome := "committed"
		if skipped {
			outcome = "skipped"
		}
		f.c.met.chunks.WithLabelValues(outcome).Inc()
		if err := f.send(chunkResponse(rg, st, skipped)); err != nil {
			f.fail(err)
			return
		}
	}
}

// send emits x, one call at a time: the workers report their chunks
// concurrently, and emit need not be safe for that.
func (f *fillRun) send(x *pb.FillResponse) error {
	f.emitMu.Lock()
	defer f.emitMu.Unlock()
	if x.Progress == nil { // a progress message has no other field
		x.CacheDir = f.c.opt.CacheDir
	}
	return f.emit(x)
}

// relay sends f.prog's news as progress messages, paced, until the
// returned stop is called (the fill is done) or ctx ends. It sends only
// what the fill's work said: it has no timer of its own.
func (f *fillRun) relay(ctx context.Context) (stop func()) {
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		pace := &pacer{every: f.c.progressEvery()}
		var lastDone int32
		for {
			select {
			case <-f.prog.c:
			case <-done:
				return
			case <-ctx.Done():
				return
			}
			if !pace.due() {
				continue
			}
			queued, _ := f.c.b.depth()
			// A failed send fails the chunk's own report too: nothing to do here.
			_ = f.send(&pb.FillResponse{Progress: f.prog.msg(&lastDone, queued)})
		}
	}()
	return func() {
		close(done)
		wg.Wait()
	}
}

// fail records err as the fill's error if it is the first, and cancels
// the fill: the chunks in flight abort, and no more are begun.
func (f *fillRun) fail(err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.err == nil {
		f.err = err
		f.cancel()
	}
}

// result is the fill's error once its workers are done: the first
// failure, else the cancellation of ctx, else the chunks left busy (nil
// when there were none).
func (f *fillRun) result(ctx context.Context) error {
	if f.err != nil {
		return f.err
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	return busyError(f.busy)
}

// busyError is the error of a fill that did all it could but the chunks
// that other writers were computing (each a cache.ErrRangeBusy): the
// caller tries them again later (RunFill does), when they are done or
// free. nil for none.
func busyError(busy []error) error {
	if len(busy) == 0 {
		return nil
	}
	sort.Slice(busy, func(i, j int) bool { return busyStart(busy[i]) < busyStart(busy[j]) })
	return fmt.Errorf("%d chunks left to another writer, which is computing them now; fill them again later (the first: %w)", len(busy), busy[0])
}

func busyStart(err error) int64 {
	var be *cache.BusyError
	if errors.As(err, &be) {
		return be.Want.Start
	}
	return 0
}

// testHookChunkBegun, when set (tests), runs when a chunk's range is
// claimed, before it is computed; testHookBeforeChunk before it is
// claimed.
var testHookChunkBegun, testHookBeforeChunk func(c *Core, r cache.Range)

// testHookFillRead, when set (tests), runs when a Fill has read which
// chunks are done.
var testHookFillRead func(c *Core)

// fillChunk computes and commits one chunk, counting its samples into st;
// prog (nil: none asked) hears of each of its forward groups.
func (c *Core) fillChunk(ctx context.Context, cw *cache.Cache, d *data.Dataset, rg cache.Range, k int, temp float32, kind cache.Targets, draws int, st *data.Stats, prog *progress) (int64, bool, error) {
	if testHookBeforeChunk != nil {
		testHookBeforeChunk(c, rg)
	}
	w, err := cw.BeginChunk(rg.Start, rg.End)
	if errors.Is(err, cache.ErrRangeDone) {
		return 0, true, nil
	}
	if err != nil {
		return 0, false, err
	}
	committed := false
	defer func() {
		if !committed {
			w.Abort()
		}
	}()
	c.flight(rg, 1)
	defer c.flight(rg, -1)
	if testHookChunkBegun != nil {
		testHookChunkBegun(c, rg)
	}
	samples, err := d.Range(ctx, rg.Start, rg.End)
	if err != nil {
		return 0, false, err
	}
	var tokens int64
	for i := range samples {
		s := &samples[i]
		st.Add(*s)
		switch {
		case s.Status == data.Dropped || s.Status == data.Skipped:
			// Kept as an empty row, so indexes stay those of the dataset;
			// the trainer skips samples without tokens.
			s.IDs, s.Mask = nil, nil
			continue
		case len(s.IDs) == 0:
			return 0, false, errkind.Errorf(ErrInvalid, "sample %d (%s) has no tokens: a pre-tokenized dataset needs input_ids in every record (text records need a tokenizer: do not mark the dataset pre-tokenized)",
				s.Index, s.Loc)
		case len(s.IDs) > c.lim.MaxLen:
			return 0, false, errkind.Errorf(ErrInvalid, "sample %d (%s) has %d tokens, more than the %s limit %d (min of max_position_embeddings and the token budget): set %s",
				s.Index, s.Loc, len(s.IDs), c.say("daemon's", "teacher's"), c.lim.MaxLen, c.say("the dataset's max_len", "--max-len, or raise --token-budget"))
		}
		tokens += int64(len(s.IDs))
	}
	// Pack exactly as infer.Model.TopK does: in order, greedily up to the
	// budget, each group an exclusive forward.
	var live []*data.Sample // the samples with tokens, in order
	for i := range samples {
		if len(samples[i].IDs) > 0 {
			live = append(live, &samples[i])
		}
	}
	var jobs []*job
	for a := 0; a < len(live); {
		b, n := a, 0
		var group [][]int32
		var index []int64
		for b < len(live) && n+len(live[b].IDs) <= c.budget {
			n += len(live[b].IDs)
			group = append(group, live[b].IDs)
			index = append(index, live[b].Index)
			b++
		}
		j := newJob(ctx, group, k, temp, true)
		j.prog = prog
		if prog != nil {
			prog.total.Add(1)
		}
		if kind != cache.TargetsTopK {
			// Keyed by the dataset and each sample's index, so the draws
			// do not depend on the chunking, packing or node.
			key := cache.DrawKey(d.Fingerprint())
			j.draws = &infer.Draws{N: draws, Head: kind == cache.TargetsHeadSampled,
				U: func(s, t, dd int) float64 { return cache.DrawUniform(key, index[s], t, dd) }}
		}
		if err := c.b.submit(j); err != nil {
			return 0, false, err
		}
		jobs = append(jobs, j)
		a = b
	}
	// Rows go into the chunk in index order: empty ones as they come, the
	// others from their forward's results.
	si := 0
	addEmpty := func() error {
		for si < len(samples) && len(samples[si].IDs) == 0 {
			if err := w.Add(cache.Sample{Index: samples[si].Index}); err != nil {
				return err
			}
			si++
		}
		return nil
	}
	for _, j := range jobs {
		res := j.wait()
		if res.err != nil {
			return 0, false, res.err
		}
		if prog != nil {
			// A forward pass of this chunk returned: the honest sign
			// that the teacher computes (a hung forward never gets here).
			prog.done.Add(1)
			prog.poke()
		}
		off, pos, doff := 0, 0, 0
		for range j.samples {
			if err := addEmpty(); err != nil {
				return 0, false, err
			}
			s := &samples[si]
			T := len(s.IDs)
			sz := T * k
			cs := cache.Sample{Index: s.Index, Tokens: s.IDs, Mask: s.Mask, TopKIDs: res.ids[off : off+sz], TopKLogProbs: res.lps[off : off+sz]}
			if j.draws != nil {
				dr := &res.draws
				cs.DrawN = dr.N[pos : pos+T]
				nd := 0
				for _, v := range cs.DrawN {
					nd += int(v)
				}
				cs.DrawIDs, cs.DrawCounts = dr.IDs[doff:doff+nd], dr.Counts[doff:doff+nd]
				if dr.Tail != nil {
					cs.TailMass = dr.Tail[pos : pos+T]
				}
				doff += nd
			}
			if err := w.Add(cs); err != nil {
				return 0, false, err
			}
			off += sz
			pos += T
			si++
		}
	}
	if err := addEmpty(); err != nil {
		return 0, false, err
	}
	if err := ctx.Err(); err != nil {
		return 0, false, err
	}
	committed = true
	if err := w.Commit(); err != nil {
		return 0, false, err
	}
	return tokens, false, nil
}
