package trainer

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"

	"distill/compute"
	"distill/model"
	"distill/train"
	"distill/train/optim"
)

// Sharded checkpoints (checkpoint.layout: sharded, the default of a
// data-parallel run at ZeRO stages 1 to 3): every rank writes the part of
// the optimizer state it holds, and no rank gathers the model.
//
//	checkpoints/step-NNNNNNNN/
//	  config.json                        the student's HF config (rank 0)
//	  state.json                         as a gathered checkpoint's (rank 0)
//	  shard-RRRRR-of-NNNNN.safetensors   rank R's pieces: for each of its optimizer
//	                                     groups, a part [OFF, OFF+n) of tensor NAME, three
//	                                     F32 tensors of n values:
//	                                       NAME@OFF              the fp32 master weights
//	                                       exp_avg.NAME@OFF      AdamW's first moment
//	                                       exp_avg_sq.NAME@OFF   AdamW's second moment
//	  manifest.json                      written last, by rank 0: the layout, the world
//	                                     size and ZeRO stage, each shard's file and bytes
//
// The pieces are the ranks' optimizer groups: under ZeRO-1 each rank's
// slice of the parameter arena, at stages 2 and 3 its part of every
// sharding unit (train.Sharding), both cut at the tensors' boundaries. The
// pieces of all shards cover every tensor exactly once.
//
// A save is three collective steps, so that the directory is published
// only when every shard is durable:
//
//  1. rank 0 makes the temporary directory checkpoints/.tmp-step-N-sharded
//     (every rank must see the same run_dir: a filesystem all nodes
//     mount, as a resume needs anyway);
//  2. every rank writes its shard (internal/atomicfile: temp file, fsync,
//     rename, directory fsync), then the ranks all-reduce their failures;
//  3. rank 0 checks each shard against the pieces its rank must hold,
//     writes config.json, state.json and manifest.json, syncs, renames the
//     directory into place and syncs the parent; the ranks then agree on
//     whether it published.
//
// A crash anywhere leaves the previous checkpoints as they were and no
// directory under a final name without its manifest. A resume at any
// world size or stage reads, for each piece it needs, the overlapping
// pieces of the shards (shardedCkpt.read): a sharded checkpoint re-shards
// itself. `student export` reads it tensor by tensor.

// Layouts of checkpoint.layout.
const (
	layoutAuto     = "auto"
	layoutGathered = "gathered"
	layoutSharded  = "sharded"
)

// shardManifestName marks a sharded checkpoint; it is written last.
const shardManifestName = "manifest.json"

// shardFormat names the layout in manifest.json.
const shardFormat = model.ShardedTrainingFormat

// shardManifest is manifest.json.
type shardManifest struct {
	Format    string       `json:"format"`
	Version   int          `json:"version"`
	Step      int          `json:"step"`
	WorldSize int          `json:"world_size"`
	ZeRO      int          `json:"zero"`
	Shards    []shardEntry `json:"shards"`
}

type shardEntry struct {
	File   string `json:"file"`
	Bytes  int64  `json:"bytes"`
	Pieces int    `json:"pieces"`
}

// shardFile is rank r's shard of a group of n.
func shardFile(r, n int) string { return fmt.Sprintf("shard-%05d-of-%05d.safetensors", r, n) }

// pieceKey names a piece's tensor in a shard ("" prefix: the weights).
func pieceKey(prefix, name string, off int) string {
	return prefix + name + "@" + strconv.Itoa(off)
}

// shardLayout is what a run saves sharded: the world, and the pieces of
// every rank (what rank 0 checks each shard against).
type shardLayout struct {
	g      *ranks
	zero   int
	pieces func(r int) []train.Piece
}

// shardLayout is the run's sharded checkpoint layout, or nil to save gathered (a
// single process, ZeRO 0, a LoRA run, or checkpoint.layout: gathered).
func (r *trainRun) shardLayout() *shardLayout {
	switch {
	case r.g.size == 1 || r.s.LoRA() != nil || r.cfg.Checkpoint.Layout == layoutGathered:
		return nil
	case r.z1 != nil:
		z := r.z1
		return &shardLayout{g: &r.g, zero: 1, pieces: func(rk int) []train.Piece { return piecesOf(r.s.Tensors, z.bounds[rk], z.bounds[rk+1]) }}
	case r.s.ShardStage() > 0:
		return &shardLayout{g: &r.g, zero: r.s.ShardStage(), pieces: r.s.ShardPieces}
	}
	return nil // ZeRO 0: every rank holds everything; rank 0 writes it
}

// failed all-reduces err over the ranks: every rank learns which ranks
// failed (in order; nil: none). A collective: every rank calls it.
func (l *shardLayout) failed(err error) []int {
	v := make([]float64, l.g.size)
	if err != nil {
		v[l.g.rank] = 1
	}
	l.g.reduceSums(v)
	var bad []int
	for r, x := range v {
		if x > 0 {
			bad = append(bad, r)
		}
	}
	return bad
}

// saveSharded writes the checkpoint of st.Step as this rank's shard (see
// the layout above); rank 0 publishes it. Every rank returns the same
// outcome: the checkpoint's directory, or an error naming the ranks that
// failed (this rank's own error in full).
//
// pre is rank 0's error before the save (writing the metrics it refers
// to): the save then fails on every rank alike.
func (c *checkpointer) saveSharded(l *shardLayout, s *train.Student, ad *optim.AdamW, st *State, skipping bool, pre error) (string, error) {
	parent := filepath.Join(c.runDir, "checkpoints")
	final := checkpointDir(c.runDir, st.Step)
	tmp := filepath.Join(parent, fmt.Sprintf(".tmp-%s%08d-sharded", ckptPrefix, st.Step))
	what := fmt.Sprintf("saving the sharded checkpoint of step %d", st.Step)
	g := l.g
	abort := func(err error, bad []int, stage string) (string, error) {
		if g.leader() {
			os.RemoveAll(tmp)
		}
		if err != nil {
			return "", fmt.Errorf("%s: rank %d: %w", what, g.rank, err)
		}
		return "", fmt.Errorf("%s: rank(s) %v failed to %s (their logs say why); the previous checkpoints are intact", what, bad, stage)
	}

	// 1. The directory.
	err := pre
	if g.leader() && err == nil {
		os.RemoveAll(tmp)
		err = os.MkdirAll(tmp, 0o755)
	}
	if bad := l.failed(err); bad != nil {
		return abort(err, bad, "prepare the save (write the metrics it follows, make "+tmp+")")
	}
	// 2. Every rank's shard.
	if _, serr := os.Stat(tmp); serr != nil {
		err = fmt.Errorf("rank 0 made %s, which this rank does not see: every rank must see the same run_dir (a filesystem all nodes mount): %w", tmp, serr)
	}
	if testHookShard != nil && err == nil {
		err = testHookShard(g.rank)
	}
	if err == nil {
		err = writeShard(filepath.Join(tmp, shardFile(g.rank, g.size)), s, ad, l.pieces(g.rank), g.be)
	}
	if bad := l.failed(err); bad != nil {
		return abort(err, bad, "write their shards")
	}
	// 3. Rank 0 checks and publishes.
	if g.leader() {
		err = c.publishSharded(l, s, st, tmp, final)
	}
	if bad := l.failed(err); bad != nil {
		return abort(err, bad, "publish the checkpoint")
	}
	protect := c.protect(st.Step, skipping)
	c.saved = st.Step
	if !skipping {
		c.good = st.Step
	}
	if g.leader() {
		if err := pruneCheckpoints(c.runDir, c.keep, protect); err != nil {
			return final, err
		}
	}
	return final, nil
}

// testHookShard, when set (tests), runs before a rank writes its shard;
// an error stands for the rank's failed write (a full disk).
var testHookShard func(rank int) error

// writeShard writes path: the rank's pieces (its optimizer groups, in
// order) of the master weights and both moments, one piece in host
// memory at a time.
func writeShard(path string, s *train.Student, ad *optim.AdamW, pieces []train.Piece, be compute.Backend) error {
	if len(pieces) != len(ad.Groups) {
		return fmt.Errorf("the rank holds %d optimizer groups, its layout %d pieces", len(ad.Groups), len(pieces))
	}
	var v []float32
	var buf []byte
	bytesOf := func(t compute.Tensor, n int) func() ([]byte, error) {
		return func() ([]byte, error) {
			if cap(v) < n {
				v = make([]float32, n)
			}
			v = v[:n]
			be.ReadF32(t, v)
			buf = model.F32Bytes(buf, v)
			return buf, nil
		}
	}
	var ts []model.StreamTensor
	for j, p := range pieces {
		g := ad.Groups[j]
		name := s.Tensors[p.Tensor].Name
		if g.Name != name || g.P.Len() != p.N {
			return fmt.Errorf("optimizer group %d is %s of %d values, its piece %s of %d", j, g.Name, g.P.Len(), name, p.N)
		}
		m, mv := ad.MomentTensors(j)
		shape := []int{p.N}
		ts = append(ts,
			model.StreamTensor{Name: pieceKey("", name, p.Off), DType: "F32", Shape: shape, Bytes: bytesOf(g.P, p.N)},
			model.StreamTensor{Name: pieceKey("exp_avg.", name, p.Off), DType: "F32", Shape: shape, Bytes: bytesOf(m, p.N)},
			model.StreamTensor{Name: pieceKey("exp_avg_sq.", name, p.Off), DType: "F32", Shape: shape, Bytes: bytesOf(mv, p.N)})
	}
	return model.WriteSafetensorsStream(path, ts, map[string]string{"format": shardFormat})
}

// publishSharded (rank 0) checks every shard in tmp against the pieces
// its rank must hold, writes config.json, state.json and manifest.json
// and renames tmp to final.
func (c *checkpointer) publishSharded(l *shardLayout, s *train.Student, st *State, tmp, final string) error {
	man := shardManifest{Format: shardFormat, Version: 1, Step: st.Step, WorldSize: l.g.size, ZeRO: l.zero}
	for r := 0; r < l.g.size; r++ {
		name := shardFile(r, l.g.size)
		p := filepath.Join(tmp, name)
		fi, err := os.Stat(p)
		if err != nil {
			return fmt.Errorf("rank %d's shard: %w (every rank must see the same run_dir: a filesystem all nodes mount)", r, err)
		}
		w, err := model.OpenFile(p)
		if err != nil {
			return fmt.Errorf("rank %d's shard: %w", r, err)
		}
		ps := l.pieces(r)
		for _, pc := range ps {
			key := pieceKey("", s.Tensors[pc.Tensor].Name, pc.Off)
			if info, ok := w.Info(key); !ok || info.Numel() != pc.N {
				w.Close()
				return fmt.Errorf("rank %d's shard %s lacks %s of %d values", r, p, key, pc.N)
			}
		}
		w.Close()
		man.Shards = append(man.Shards, shardEntry{File: name, Bytes: fi.Size(), Pieces: len(ps)})
	}
	return publishCheckpoint(tmp, final, s, st, &man)
}

// shardedCkpt is a sharded checkpoint open for reading: its shards
// memory-mapped and every piece indexed by tensor.
type shardedCkpt struct {
	dir    string
	man    shardManifest
	files  []*model.Weights
	pieces map[string][]ckPiece // by key prefix + tensor name, sorted by off
}

// ckPiece is where one piece of a tensor lies.
type ckPiece struct {
	off, n int
	file   int
	key    string
}

// isSharded reports whether dir holds a sharded checkpoint.
func isSharded(dir string) bool {
	_, err := os.Stat(filepath.Join(dir, shardManifestName))
	return err == nil
}

// openSharded opens the sharded checkpoint in dir, checking the manifest
// against the files.
func openSharded(dir string) (*shardedCkpt, error) {
	b, err := os.ReadFile(filepath.Join(dir, shardManifestName))
	if err != nil {
		return nil, err
	}
	c := &shardedCkpt{dir: dir, pieces: map[string][]ckPiece{}}
	if err := json.Unmarshal(b, &c.man); err != nil {
		return nil, fmt.Errorf("%s/%s: %v", dir, shardManifestName, err)
	}
	if c.man.Format != shardFormat || c.man.Version != 1 || len(c.man.Shards) != c.man.WorldSize || c.man.WorldSize < 1 {
		return nil, fmt.Errorf("%s/%s: format %q version %d with %d shards of a world of %d: not a sharded checkpoint this build reads",
			dir, shardManifestName, c.man.Format, c.man.Version, len(c.man.Shards), c.man.WorldSize)
	}
	for i, e := range c.man.Shards {
		p := filepath.Join(dir, e.File)
		fi, err := os.Stat(p)
		if err != nil {
			c.close()
			return nil, fmt.Errorf("shard %d of %s: %w", i, dir, err)
		}
		if fi.Size() != e.Bytes {
			c.close()
			return nil, fmt.Errorf("shard %d of %s: %s has %d bytes, the manifest says %d: the file was changed or truncated after the checkpoint was written", i, dir, p, fi.Size(), e.Bytes)
		}
		w, err := model.OpenFile(p)
		if err != nil {
			c.close()
			return nil, fmt.Errorf("shard %d of %s: %w", i, dir, err)
		}
		c.files = append(c.files, w)
		for _, key := range w.Names() {
			at := strings.LastIndexByte(key, '@')
			off, err := strconv.Atoi(key[at+1:])
			info, _ := w.Info(key)
			if at < 0 || err != nil || off < 0 || info.DType != "F32" || len(info.Shape) != 1 {
				c.close()
				return nil, fmt.Errorf("shard %d of %s: tensor %q is no piece (NAME@OFFSET, F32, one dimension)", i, p, key)
			}
			c.pieces[key[:at]] = append(c.pieces[key[:at]], ckPiece{off: off, n: info.Shape[0], file: i, key: key})
		}
	}
	for name, ps := range c.pieces {
		sort.Slice(ps, func(a, b int) bool { return ps[a].off < ps[b].off })
		for j := 1; j < len(ps); j++ {
			if ps[j].off < ps[j-1].off+ps[j-1].n {
				c.close()
				return nil, fmt.Errorf("%s: pieces %s and %s of %s overlap", dir, ps[j-1].key, ps[j].key, name)
			}
		}
	}
	return c, nil
}

// read fills dst with elements [off, off+len(dst)) of tensor key (a
// tensor name, or exp_avg./exp_avg_sq. and its name) of full elements,
// from the pieces that overlap them; a gap, or a tensor of another
// length, is an error naming it.
func (c *shardedCkpt) read(key string, full, off int, dst []float32) error {
	ps := c.pieces[key]
	if len(ps) == 0 {
		return fmt.Errorf("%w: %s holds no piece of %s", ErrResume, c.dir, key)
	}
	if last := ps[len(ps)-1]; last.off+last.n != full {
		return fmt.Errorf("%w: %s holds %s up to element %d, want %d: another architecture", ErrResume, c.dir, key, last.off+last.n, full)
	}
	at, end := off, off+len(dst)
	for _, p := range ps {
		lo, hi := max(at, p.off), min(end, p.off+p.n)
		if lo >= hi {
			continue
		}
		if lo != at {
			break // a gap at element at
		}
		raw, _, err := c.files[p.file].Raw(p.key)
		if err != nil {
			return err
		}
		for i := lo; i < hi; i++ {
			u := binary.LittleEndian.Uint32(raw[4*(i-p.off):])
			if u&0x7f800000 == 0x7f800000 {
				return fmt.Errorf("%w: %s: %s holds a non-finite value at element %d", ErrResume, c.dir, key, i)
			}
			dst[i-off] = math.Float32frombits(u)
		}
		at = hi
	}
	if at != end {
		return fmt.Errorf("%w: %s: no shard holds element %d of %s: a shard is missing or was written by another layout", ErrResume, c.dir, at, key)
	}
	return nil
}

func (c *shardedCkpt) close() {
	for _, w := range c.files {
		w.Close()
	}
}

// loadShardedStudent builds the student of the sharded checkpoint dir on
// be (one rank's part of it when sh is set), a tensor at a time.
func loadShardedStudent(dir string, be compute.Backend, sh *train.Sharding) (*train.Student, error) {
	cfg, err := model.LoadConfig(dir)
	if err != nil {
		return nil, err
	}
	c, err := openSharded(dir)
	if err != nil {
		return nil, err
	}
	defer c.close()
	return train.LoadFrom(cfg, be, sh, func(t train.Tensor, dst []float32) error { return c.read(t.Name, t.N, 0, dst) })
}
