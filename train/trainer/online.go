package trainer

import (
	"fmt"
	"io"
	"strings"

	"distill/cache"
	"distill/data"
	"distill/model"
)

// online is a run's live teacher (distill.teachers) and its write-through
// cache.
type online struct {
	cfg  *OnlineConfig
	pool *teacherPool
	wc   *writeCache
	m    cache.Manifest
	eval []cache.Sample // the eval samples with their answers, asked once
	log  io.Writer
}

// startOnline dials the teacher's replicas, checks each one's Info
// against the student (tokenizer, vocabulary, k, sample length) before
// step 1, and fills m as a cache of that teacher would be: teacher
// fingerprint, k, capture temperature. It opens the write cache.
func startOnline(cfg *Config, sc *model.Config, tokFP string, maxLen int, m *cache.Manifest, log io.Writer) (*online, error) {
	oc := &cfg.Distill.OnlineConfig
	t := oc.Teachers[0]
	fmt.Fprintf(log, "teachers: checking teacher %s at %s (Info: tokenizer, vocab, k)\n", t.Name, strings.Join(t.Addrs, ", "))
	pool, err := newTeacherPool(t, oc, infoWant{tokenizer: tokFP, vocab: sc.VocabSize, k: int32(oc.K), maxLen: maxLen}, log)
	if err != nil {
		return nil, err
	}
	in, err := pool.ready()
	if err != nil {
		pool.close()
		return nil, err
	}
	m.TeacherFingerprint, m.K, m.Temperature = in.GetTeacherFingerprint(), int(pool.k), float32(oc.CaptureTemperature)
	m.VocabSize, m.Encoding, m.FormatVersion = int(in.GetVocabSize()), cache.Encoding(oc.WriteEncoding), cache.FormatVersion
	fmt.Fprintf(log, "teachers: teacher %s: %s, %.1fM params, fingerprint %.12s, on %d replica(s); k %d at temperature %g; prefetch %d samples\n",
		t.Name, in.GetArchitecture(), float64(in.GetParams())/1e6, in.GetTeacherFingerprint(), len(t.Addrs), pool.k, oc.CaptureTemperature, oc.Prefetch)
	on := &online{cfg: oc, pool: pool, m: *m, log: log}
	if oc.WriteCache != "" {
		if on.wc, err = openWriteCache(oc.WriteCache, *m, oc.ChunkSamples); err != nil {
			pool.close()
			return nil, err
		}
		fmt.Fprintf(log, "teachers: writing every answer through to cache %s (%s encoding, chunks of %d samples)\n", oc.WriteCache, oc.WriteEncoding, oc.ChunkSamples)
	}
	return on, nil
}

// stream starts the training order at (epoch, pos).
func (on *online) stream(ds *data.Dataset, cfg *Config, held cache.Range, workers int, epoch int, pos int64) (sampleStream, error) {
	return newOnlineStream(ds, on.pool, on.wc, cfg.Seed, cfg.Data.ShuffleWindow, on.cfg.ChunkSamples, held, workers, on.cfg.Prefetch, epoch, pos)
}

// evalSamples gives the eval samples the teacher's top-k: from the write
// cache where it has them, else asked (once per run).
func (on *online) evalSamples(ss []cache.Sample) ([]cache.Sample, error) {
	if on.eval != nil {
		return on.eval, nil
	}
	var ask []*cache.Sample
	for i := range ss {
		if len(ss[i].Tokens) == 0 {
			continue
		}
		if on.wc != nil {
			if s, ok, err := on.wc.get(ss[i].Index); err != nil {
				return nil, err
			} else if ok {
				ss[i] = s
				continue
			}
		}
		ask = append(ask, &ss[i])
	}
	if err := on.pool.score(ask); err != nil {
		return nil, fmt.Errorf("teacher answers for the eval samples: %w", err)
	}
	on.eval = ss
	return ss, nil
}

// close stops the teachers' streams, then commits the complete chunks of
// the write cache.
func (on *online) close() error {
	on.pool.close()
	if on.wc != nil {
		return on.wc.close()
	}
	return nil
}
