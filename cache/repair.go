package cache

import (
	"encoding/binary"
	"errors"
	"fmt"

	badger "github.com/dgraph-io/badger/v4"
)

// RepairReport says what Repair changed.
type RepairReport struct {
	// Checked counts the chunk records examined.
	Checked int
	// Dropped are the chunk records removed, in order: their ranges are
	// missing now, and a fill recomputes exactly them.
	Dropped []ChunkInfo
	// Problems has one line per dropped chunk: what was wrong with it.
	Problems []string
	// Rekeyed counts the chunks whose sample keys were rewritten (missing
	// or pointing elsewhere); StrayKeys the sample keys removed because
	// they pointed at no committed chunk.
	Rekeyed, StrayKeys int
	// Files are the removed paths, relative to the cache directory: the
	// dropped chunks' files and what GC removes.
	Files []string
}

// Repair makes the index of dir agree with its chunk files, so that Check
// comes back clean once a fill has recomputed what Repair dropped. It
// drops the record (and the sample keys) of every chunk whose file is
// missing or fails the checks of Check (size, CRC-32C, structure, decoding,
// token count), and of records that overlap an earlier one, end past the
// manifest's samples or name another file than their range's; it rewrites
// sample keys that are missing or wrong for a good chunk and removes the
// ones that point at no chunk; then it runs GC, which removes the dropped
// chunks' files. A chunk file that cannot be read for another reason (a
// permission or I/O error) stops Repair with that error and nothing
// dropped: only chunks shown to be bad are ever dropped.
//
// The chunk files are verified first under no lock (they are immutable;
// writers keep committing meanwhile), then the index is changed under the
// exclusive lock, each dropped chunk in its own transaction (its record
// and its sample keys together), so a crash during Repair leaves a
// consistent index and Repair can simply be run again.
func Repair(dir string, opts *Options) (*RepairReport, error) {
	o := opts.withDefaults()
	if err := statIndex(dir); err != nil {
		return nil, err
	}
	m, rs, err := loadIndex(dir, o)
	if err != nil {
		return nil, err
	}
	rep := &RepairReport{Checked: len(rs)}
	bad := map[ChunkInfo]string{}
	for i, info := range rs {
		var why error
		switch {
		case i > 0 && rs[i-1].End > info.Start:
			why = fmt.Errorf("%w: chunk %s overlaps chunk %s", ErrCorrupt, info.File, rs[i-1].File)
		case info.End > m.Samples:
			why = fmt.Errorf("%w: chunk %s ends past the manifest's %d samples", ErrCorrupt, info.File, m.Samples)
		case info.File != chunkFileName(info.Range):
			why = fmt.Errorf("%w: chunk %v: file name %q, want %q", ErrCorrupt, info.Range, info.File, chunkFileName(info.Range))
		default:
			why = checkChunk(o.FS, dir, &m, info)
		}
		if why != nil && !errors.Is(why, ErrCorrupt) {
			return nil, fmt.Errorf("cache: repair: %w; nothing was changed (fix that and run repair again)", why)
		}
		if why != nil {
			bad[info] = why.Error()
		}
	}

	s, err := openIndex(dir, true, o.LockTimeout)
	if err != nil {
		return nil, err
	}
	defer s.close()
	rs, err = s.ranges() // as of now: writers may have committed meanwhile
	if err != nil {
		return nil, fmt.Errorf("%s: %w", dir, err)
	}
	var keep []ChunkInfo
	for _, info := range rs {
		why, isBad := bad[info] // the same record (file, size, CRC) as checked
		if !isBad {
			keep = append(keep, info)
			continue
		}
		err := s.db.Update(func(txn *badger.Txn) error {
			for i := info.Start; i < info.End; i++ {
				if err := txn.Delete(sampleKey(i)); err != nil {
					return err
				}
			}
			return txn.Delete(rangeKey(info.Start))
		})
		if err != nil {
			return rep, fmt.Errorf("cache: repair: dropping chunk %s: %w", info.File, err)
		}
		rep.Dropped = append(rep.Dropped, info)
		rep.Problems = append(rep.Problems, why)
	}
	if err := rekey(s, keep, rep); err != nil {
		return rep, fmt.Errorf("cache: repair: %s: %w", dir, err)
	}
	g, err := gc(s, dir, o.FS, "")
	rep.Files = append(rep.Files, g.Files...)
	return rep, err
}

// rekey makes the sample keys agree with the chunk records rs (sorted,
// non-overlapping): a key that points at no chunk is deleted, a key that is
// missing or points at the wrong chunk or row is rewritten.
func rekey(s *indexSession, rs []ChunkInfo, rep *RepairReport) error {
	var stray [][]byte
	keyed := make([]int64, len(rs))
	err := s.db.View(func(txn *badger.Txn) error {
		io := badger.DefaultIteratorOptions
		io.Prefix = []byte{keySamplePref}
		io.PrefetchValues = true
		it := txn.NewIterator(io)
		defer it.Close()
		for it.Rewind(); it.Valid(); it.Next() {
			item := it.Item()
			k := item.KeyCopy(nil)
			v, err := item.ValueCopy(nil)
			if err != nil {
				return err
			}
			c := -1
			if len(k) == 9 {
				c = findOverlap(rs, Range{int64(binary.BigEndian.Uint64(k[1:])), int64(binary.BigEndian.Uint64(k[1:])) + 1})
			}
			switch {
			case c < 0:
				stray = append(stray, k)
			case len(v) == 12 && int64(binary.BigEndian.Uint64(v)) == rs[c].Start &&
				int64(binary.BigEndian.Uint32(v[8:])) == int64(binary.BigEndian.Uint64(k[1:]))-rs[c].Start:
				keyed[c]++
			}
		}
		return nil
	})
	if err != nil {
		return err
	}
	if len(stray) > 0 {
		wb := s.db.NewWriteBatch()
		defer wb.Cancel()
		for _, k := range stray {
			if err := wb.Delete(k); err != nil {
				return err
			}
		}
		if err := wb.Flush(); err != nil {
			return err
		}
		rep.StrayKeys = len(stray)
	}
	for c, info := range rs {
		if keyed[c] == info.Len() {
			continue
		}
		err := s.db.Update(func(txn *badger.Txn) error {
			for i := info.Start; i < info.End; i++ {
				if err := txn.Set(sampleKey(i), sampleValue(info.Start, uint32(i-info.Start))); err != nil {
					return err
				}
			}
			return nil
		})
		if err != nil {
			return err
		}
		rep.Rekeyed++
	}
	return nil
}
