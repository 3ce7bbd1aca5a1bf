package trainer

import (
	"io"
	"strings"

	"distill/cache"
	"distill/internal/errkind"
	"distill/train"
)

// cacheSource is the Source of a teacher's cache (data.cache), or of
// several teachers' caches over the same samples (data.caches): the
// first cache's seeded shuffle is the training order, and the other
// teachers' top-k of each sample are read by index (teacherSet).
type cacheSource struct {
	rd     *cache.Reader // the training order's: data.cache's, or teacher 0's
	ts     *teacherSet   // data.caches; nil with one cache
	where  string        // data.cache's directories, for messages
	seed   uint64
	window int
	pk     *packer
}

// openCacheSource opens the caches of cfg. A random student without a
// vocabulary or tokenizer takes the cache's (takeCacheVocab).
func openCacheSource(cfg *Config, log io.Writer) (*cacheSource, error) {
	c := &cacheSource{where: strings.Join(cfg.Data.Cache, ","), seed: cfg.Seed, window: cfg.Data.ShuffleWindow}
	if len(cfg.Data.Caches) > 0 {
		ts, err := openTeachers(cfg.Data.Caches, cfg.Data.ShuffleWindow)
		if err != nil {
			return nil, err
		}
		c.ts, c.rd = ts, ts.rds[0]
	} else {
		rd, err := cache.OpenReader(cfg.Data.Cache...)
		if err != nil {
			return nil, err
		}
		c.rd = rd
	}
	m := c.rd.Manifest()
	if err := checkTargets(cfg, c); err != nil {
		return nil, err
	}
	takeCacheVocab(cfg, &m, log)
	c.pk = newCachePacker(c.rd, c.ts, cfg.Data.SeqLen, cfg.Data.Truncate)
	return c, nil
}

// newCachePacker packs rows of rd's samples (and with several teachers,
// ts's top-k of them) into rows of seqLen tokens.
func newCachePacker(rd *cache.Reader, ts *teacherSet, seqLen int, truncate bool) *packer {
	m := rd.Manifest()
	pk := &packer{seqLen: seqLen, truncate: truncate, k: m.DenseK()}
	if m.Sampled() {
		pk.dense = &m
	}
	if ts != nil {
		pk.multi, pk.more = ts.teachers(), ts.more
	}
	return pk
}

func (c *cacheSource) Open(p SourceParams) (SourceInfo, error) {
	m := c.rd.Manifest()
	info := SourceInfo{Manifest: m, Kind: "cache", K: planK(&m, c.ts)}
	if c.ts != nil {
		info.Teachers, info.TeachersFrom, info.Where = c.ts.states(), "data.caches", c.ts.where
	}
	return info, nil
}

// Check refuses a cache (any teacher's) made with another tokenizer or
// vocabulary than the student's.
func (c *cacheSource) Check(p SourceParams) error {
	if c.ts != nil {
		return c.ts.check(p.Student, p.TokenizerFingerprint)
	}
	m := c.rd.Manifest()
	return CheckCache(p.Student, p.TokenizerFingerprint, &m, c.where)
}

// CheckEval refuses an eval range that is not all committed in every
// cache: a missing sample would fail the first eval, after the run's
// first steps and possibly before any checkpoint.
func (c *cacheSource) CheckEval(r cache.Range) error {
	if c.ts != nil {
		for i, rd := range c.ts.rds {
			if err := checkFilled(rd, r, c.ts.where(i)); err != nil {
				return err
			}
		}
		return nil
	}
	return checkFilled(c.rd, r, c.where)
}

func (c *cacheSource) Batches(held cache.Range, epoch int, pos int64) (Batches, error) {
	st, err := newStream(c.rd, c.seed, c.window, held, epoch, pos)
	if err != nil {
		return nil, err
	}
	return &packedBatches{st: st, pk: c.pk}, nil
}

func (c *cacheSource) EvalRows(r cache.Range) ([]*train.Batch, int, error) {
	return c.pk.evalRows(c.rd, r)
}

// checkTargets refuses caches whose target kind is not the run's
// (distill.targets): the loss's definition depends on it, and a run that
// meant to train on a top-k must not silently train on draws, or back.
func checkTargets(cfg *Config, c *cacheSource) error {
	want := cfg.Distill.Targets
	if want == "" {
		want = string(cache.TargetsTopK)
	}
	if c.ts != nil {
		// Each teacher's cache against its entry's kind (data.caches[i].targets,
		// default distill.targets): kinds may mix, but only as asked.
		for i, rd := range c.ts.rds {
			m := rd.Manifest()
			w := string(cfg.Data.Caches[i].targets(cfg))
			if got := string(m.Kind()); got != w {
				return errkind.Errorf(ErrConfig, "%s holds targets %s (cachectl fill --targets %s) but the run expects %s of it (data.caches[%d].targets, default distill.targets %s): set data.caches[%d].targets: %s to train on it beside the others (sampled kinds take kd_loss fwd_kl), or use a cache filled with --targets %s",
					c.ts.where(i), got, got, w, i, want, i, got, w)
			}
		}
		return nil
	}
	m := c.rd.Manifest()
	if got := string(m.Kind()); got != want {
		return errkind.Errorf(ErrConfig, "cache %s holds targets %s (cachectl fill --targets %s) but distill.targets is %s: set distill.targets: %s to train on it (sampled kinds take kd_loss fwd_kl), or use a cache filled with --targets %s",
			c.where, got, got, want, got, want)
	}
	return nil
}

// Close has nothing to release: a cache.Reader holds no open file
// between reads (each chunk is read whole and closed).
func (c *cacheSource) Close() {}

// checkFilled refuses an eval range that is not all committed in the
// cache, naming the missing samples.
func checkFilled(rd *cache.Reader, r cache.Range, where string) error {
	for _, g := range rd.Missing() {
		lo, hi := max(g.Start, r.Start), min(g.End, r.End)
		if lo < hi {
			return errkind.Errorf(ErrConfig, "data.eval_range: the eval reads samples %v, but samples %v are not in cache %s (not filled yet: `cachectl status` lists the missing ranges): fill them, or move data.eval_range (or lower eval.max_samples) into the filled samples",
				r, cache.Range{Start: lo, End: hi}, where)
		}
	}
	return nil
}
