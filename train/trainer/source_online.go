package trainer

import (
	"distill/cache"
	"distill/train"
)

// onlineSource is the Source of online KD (distill.teachers): a dataset
// whose samples live teachers score ahead of the step (onlineStream),
// with no cache, or through their write caches.
type onlineSource struct {
	*datasetSource
	cfg *Config
	on  *online // set by Open
}

// Open opens the dataset, then dials every teacher's replicas and checks
// their Info against the student before step 1; teacher 0 then stands
// where a cache's manifest would.
func (o *onlineSource) Open(p SourceParams) (SourceInfo, error) {
	info, err := o.datasetSource.Open(p)
	if err != nil {
		return info, err
	}
	m := info.Manifest
	if o.on, err = startOnline(o.cfg, p.Student, p.TokenizerFingerprint, o.maxLen, &m, p.Log); err != nil {
		return info, err
	}
	info.Manifest, info.NoTeacher, info.K = m, false, m.DenseK()
	info.Teachers, info.TeachersFrom, info.Where = o.on.states(), "distill.teachers", o.on.where
	o.pk = &packer{seqLen: o.pk.seqLen, truncate: o.pk.truncate, k: m.DenseK()}
	if m.Sampled() {
		// The answers carry draws, as a cache of that kind: the packer
		// turns them into fixed-width rows alike (cache.Dense).
		o.pk.dense = &o.on.m
	}
	if o.on.multi() {
		o.pk.multi = o.on.teachers() // the online stream carries the other teachers' top-k
		k := 0
		for _, t := range o.pk.multi {
			k += t.K
		}
		info.K = k // as planK of data.caches
	}
	return info, nil
}

func (o *onlineSource) Batches(held cache.Range, epoch int, pos int64) (Batches, error) {
	st, err := o.on.stream(o.ds, o.cfg, held, o.workers, epoch, pos)
	if err != nil {
		return nil, err
	}
	return &packedBatches{st: st, pk: o.pk}, nil
}

// EvalRows gives the held-out samples every teacher's top-k (asked once
// per run, or read from the write caches) and packs them.
func (o *onlineSource) EvalRows(r cache.Range) ([]*train.Batch, int, error) {
	ss, err := dsEvalSamples(o.ds, r)
	var more map[int64][]teacherTopK
	if err == nil {
		ss, more, err = o.on.evalSamples(ss)
	}
	if err != nil {
		return nil, 0, err
	}
	pk := *o.pk
	if more != nil {
		pk.more = func(s cache.Sample) ([]teacherTopK, error) { return more[s.Index], nil }
	}
	return packSamples(&pk, ss)
}

// Close stops the teachers (committing their write caches' complete
// chunks), then closes the dataset.
func (o *onlineSource) Close() {
	if o.on != nil {
		o.on.close()
	}
	o.datasetSource.Close()
}
