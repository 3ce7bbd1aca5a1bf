package serve

import (
	"context"
	"crypto/rand"
	"crypto/subtle"
	"encoding/hex"
	"errors"
	"io"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/reflection"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"distill/internal/teacherdial"
	pb "distill/proto/distill/v1"
)

// scoreWindow is how many samples of one Score stream may be in flight
// (queued or computing) before the stream stops reading: it pipelines a
// stream without letting one client hold the whole queue.
const scoreWindow = 64

// Server implements the Teacher gRPC service over a Core. Its handlers are
// thin: validate, call the core, map the error with toStatus. Until the
// core is set (model loading) every RPC answers Unavailable and the health
// service reports NOT_SERVING.
type Server struct {
	pb.UnimplementedTeacherServer
	core   atomic.Pointer[Core]
	log    *zap.Logger
	health *health.Server
	roots  *DataRoots
	// authFailures counts calls refused for a missing or wrong token; it
	// joins the core's registry in SetCore.
	authFailures prometheus.Counter
	// draining is closed by Draining: open Score streams end once they
	// have answered what they hold (a client's stream is open as long as
	// its run, so a drain waited for it until --drain-timeout).
	draining  chan struct{}
	drainOnce sync.Once
}

// errDraining ends a Score stream when the daemon drains: the client's
// unanswered samples go to another replica, or wait for this one.
var errDraining = status.Error(codes.Unavailable, "teacherd is shutting down (SIGTERM or Ctrl-C): the samples not answered on this stream are to be asked again, of another replica or of this daemon once it is back")

// requestIDKey is the context key of the id the interceptors give every
// call: the client's error messages carry it, the log lines too.
type requestIDKey struct{}

func newRequestID() string {
	var b [6]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

func requestID(ctx context.Context) string {
	id, _ := ctx.Value(requestIDKey{}).(string)
	if id == "" {
		return "none"
	}
	return id
}

// toClient maps a core error for the client of the call in ctx.
func (s *Server) toClient(ctx context.Context, err error) error {
	return clientStatus(s.log, requestID(ctx), err)
}

// confine checks the dataset's paths against the data roots: Fill and
// DescribeDataset are the RPCs that name files.
func (s *Server) confine(spec *pb.Dataset) (*pb.Dataset, error) {
	if err := ValidateDataset(spec); err != nil {
		return nil, err
	}
	return s.roots.Confine(spec)
}

func (s *Server) ready() (*Core, error) {
	c := s.core.Load()
	if c == nil {
		return nil, status.Error(codes.Unavailable, "teacher model still loading: retry when the health check reports SERVING")
	}
	return c, nil
}

// Info implements pb.TeacherServer.
func (s *Server) Info(ctx context.Context, _ *pb.InfoRequest) (*pb.InfoResponse, error) {
	c, err := s.ready()
	if err != nil {
		return nil, err
	}
	return c.Info(), nil
}

// DescribeDataset implements pb.TeacherServer.
func (s *Server) DescribeDataset(ctx context.Context, r *pb.DescribeDatasetRequest) (*pb.DescribeDatasetResponse, error) {
	c, err := s.ready()
	if err != nil {
		return nil, err
	}
	spec, err := s.confine(r.GetDataset())
	if err != nil {
		return nil, err
	}
	out, err := c.DescribeDataset(spec)
	return out, s.toClient(ctx, err)
}

// Status implements pb.TeacherServer.
func (s *Server) Status(ctx context.Context, r *pb.StatusRequest) (*pb.StatusResponse, error) {
	c, err := s.ready()
	if err != nil {
		return nil, err
	}
	out, err := c.Status(r)
	return out, s.toClient(ctx, err)
}

// Fill implements pb.TeacherServer.
func (s *Server) Fill(r *pb.FillRequest, stream grpc.ServerStreamingServer[pb.FillResponse]) error {
	c, err := s.ready()
	if err != nil {
		return err
	}
	if err := ValidateFill(r, c.Limits()); err != nil {
		return err
	}
	spec, err := s.confine(r.GetDataset())
	if err != nil {
		return err
	}
	r = proto.Clone(r).(*pb.FillRequest)
	r.Dataset = spec
	return s.toClient(stream.Context(), c.Fill(stream.Context(), r, stream.Send))
}

// Score implements pb.TeacherServer: a reader goroutine validates and
// queues each sample (at most scoreWindow in flight), the handler sends
// results in request order. The first error ends the stream. A sample of
// a sampled kind draws in the LM head as a fill does, keyed by the
// request's dataset fingerprint and sample index.
func (s *Server) Score(stream grpc.BidiStreamingServer[pb.ScoreRequest, pb.ScoreResponse]) error {
	c, err := s.ready()
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(stream.Context())
	defer cancel()
	pace := &pacer{every: c.progressEvery()}
	type pending struct {
		id  int64
		j   *job
		k   int
		t0  time.Time
		err error
	}
	q := make(chan pending, scoreWindow)
	// prog hears when the queue moves while this stream's samples wait
	// in it; attached to them once a request asks for progress (an
	// older client reads every message as a result).
	prog := newProgress()
	var asked atomic.Bool
	// The reader is not waited for: on an early return it may sit in
	// Recv, which returns once the handler has returned and the stream's
	// context ends.
	go func() {
		defer close(q)
		for {
			r, err := stream.Recv()
			if err != nil {
				if ctx.Err() == nil && !isEOF(err) {
					q <- pending{err: err}
				}
				return
			}
			t0 := time.Now()
			if r.GetProgress() {
				asked.Store(true)
			}
			var jp *progress
			if asked.Load() {
				jp = prog
			}
			j, err := c.submitScore(ctx, r, jp)
			k, _ := c.defaults(r.K, r.GetTemperature())
			if j != nil && j.draws != nil {
				k = j.k // 0 under sampled: no head
			}
			select {
			case q <- pending{id: r.GetId(), j: j, k: k, t0: t0, err: err}:
			case <-ctx.Done():
				return
			}
			if err != nil {
				return
			}
		}
	}()
	for {
		var p pending
		var ok bool
		select {
		case p, ok = <-q:
		case <-s.draining:
			// Answer what is queued already, then end the stream.
			select {
			case p, ok = <-q:
			default:
				return errDraining
			}
		}
		if !ok {
			break
		}
		if p.err != nil {
			return s.toClient(ctx, p.err)
		}
		res, err := awaitScore(ctx, c, stream, p.j, prog, pace)
		if err != nil {
			return err
		}
		if res.err != nil {
			return s.toClient(ctx, res.err)
		}
		c.met.latency.WithLabelValues("Score.sample").Observe(time.Since(p.t0).Seconds())
		out := &pb.ScoreResponse{Id: p.id, K: int32(p.k), Ids: res.ids, Logprobs: res.lps}
		if p.j.draws != nil {
			out.DrawN, out.DrawIds, out.DrawCounts, out.TailMass = res.draws.N, res.draws.IDs, res.draws.Counts, res.draws.Tail
		}
		if err := stream.Send(out); err != nil {
			return err
		}
		pace.sent()
	}
	return nil
}

// awaitScore waits for j's result, sending a Progress message ("queued")
// on the stream when prog hears that the queue moved, at most as often
// as pace allows. Its error is the stream's (a failed Send).
func awaitScore(ctx context.Context, c *Core, stream grpc.BidiStreamingServer[pb.ScoreRequest, pb.ScoreResponse], j *job, prog *progress, pace *pacer) (jobResult, error) {
	for {
		select {
		case r := <-j.done:
			return r, nil
		case <-ctx.Done():
			return jobResult{err: ctx.Err()}, nil
		case <-prog.c:
			if !pace.due() {
				continue
			}
			var none int32
			queued, _ := c.b.depth()
			if err := stream.Send(&pb.ScoreResponse{Progress: prog.msg(&none, queued)}); err != nil {
				return jobResult{}, err
			}
		}
	}
}

func isEOF(err error) bool { return errors.Is(err, io.EOF) }

// Auth and limits live in interceptors, not handlers.

// unprotected are the methods open without a token: health checks and
// reflection, so probes and grpcurl list work.
func unprotected(method string) bool {
	return strings.HasPrefix(method, "/grpc.health.v1.Health/") || strings.HasPrefix(method, "/grpc.reflection.")
}

func checkToken(ctx context.Context, token, method string) error {
	if token == "" || unprotected(method) {
		return nil
	}
	md, _ := metadata.FromIncomingContext(ctx)
	for _, v := range md.Get("authorization") {
		if got, ok := strings.CutPrefix(v, "Bearer "); ok && subtle.ConstantTimeCompare([]byte(got), []byte(token)) == 1 {
			return nil
		}
	}
	// No client's flag: cachectl's and student train's errors add their
	// own (this said "(cachectl fill --token)" to student train and
	// cachectl score too).
	return status.Error(codes.Unauthenticated, "missing or wrong bearer token: send the token of teacherd's --token-file as metadata \"authorization: Bearer <token>\"")
}

// authFailed counts and logs a refused call (who tried what).
func (s *Server) authFailed(ctx context.Context, method string) {
	s.authFailures.Inc()
	from := "unknown"
	if p, ok := peer.FromContext(ctx); ok && p.Addr != nil {
		from = p.Addr.String()
	}
	s.log.Warn("call refused: missing or wrong bearer token", zap.String("method", method), zap.String("peer", from))
}

// idStream is a ServerStream whose context carries the request id.
type idStream struct {
	grpc.ServerStream
	ctx context.Context
}

func (s idStream) Context() context.Context { return s.ctx }

// limiter counts concurrent RPCs of the Teacher service.
type limiter struct {
	max int64
	n   atomic.Int64
}

func (l *limiter) acquire(method string) error {
	if l.max <= 0 || unprotected(method) {
		return nil
	}
	if l.n.Add(1) > l.max {
		l.n.Add(-1)
		return status.Errorf(codes.ResourceExhausted, "too many concurrent requests (limit %d, --max-concurrent): retry later", l.max)
	}
	return nil
}

func (l *limiter) release(method string) {
	if l.max > 0 && !unprotected(method) {
		l.n.Add(-1)
	}
}

func (s *Server) observe(method, id string, t0 time.Time, err error) {
	c := s.core.Load()
	code := status.Code(err)
	if c != nil {
		name := method[strings.LastIndexByte(method, '/')+1:]
		c.met.codes.WithLabelValues(name, code.String()).Inc()
		c.met.latency.WithLabelValues(name).Observe(time.Since(t0).Seconds())
	}
	if code != codes.OK && code != codes.ResourceExhausted && code != codes.Canceled {
		s.log.Info("rpc failed", zap.String("method", method), zap.String("request_id", id), zap.String("code", code.String()), zap.String("msg", status.Convert(err).Message()))
	}
}

// ServerOptions configure NewGRPCServer.
type ServerOptions struct {
	// Token, when set, is the bearer token every Teacher RPC must carry.
	Token string
	// MaxConcurrent bounds concurrent Teacher RPCs (0: no bound); more get
	// ResourceExhausted.
	MaxConcurrent int
	// MaxRecvBytes bounds one request message (default 16 MiB).
	MaxRecvBytes int
	// DataRoots are the directories whose files clients may name as
	// datasets; nil or empty: none (every Fill and DescribeDataset is
	// refused).
	DataRoots *DataRoots
	// Extra are more grpc.ServerOptions (TLS credentials).
	Extra []grpc.ServerOption
	// Logger receives structured logs; nil means zap.NewNop.
	Logger *zap.Logger
}

// NewGRPCServer returns a gRPC server with the Teacher service, standard
// health checking (NOT_SERVING until SetCore) and server reflection, and
// the Server to hand the core to once it is loaded.
func NewGRPCServer(o ServerOptions) (*grpc.Server, *Server) {
	if o.Logger == nil {
		o.Logger = zap.NewNop()
	}
	if o.MaxRecvBytes == 0 {
		o.MaxRecvBytes = 16 << 20
	}
	s := &Server{log: o.Logger, health: health.NewServer(), roots: o.DataRoots, draining: make(chan struct{}),
		authFailures: prometheus.NewCounter(prometheus.CounterOpts{Name: "teacherd_auth_failures_total",
			Help: "Calls refused for a missing or wrong bearer token."})}
	lim := &limiter{max: int64(o.MaxConcurrent)}
	unary := func(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		if err := checkToken(ctx, o.Token, info.FullMethod); err != nil {
			s.authFailed(ctx, info.FullMethod)
			return nil, err
		}
		if err := lim.acquire(info.FullMethod); err != nil {
			return nil, err
		}
		defer lim.release(info.FullMethod)
		id := newRequestID()
		grpc.SetHeader(ctx, metadata.Pairs("x-request-id", id))
		t0 := time.Now()
		resp, err := h(context.WithValue(ctx, requestIDKey{}, id), req)
		s.observe(info.FullMethod, id, t0, err)
		return resp, err
	}
	streamI := func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, h grpc.StreamHandler) error {
		if err := checkToken(ss.Context(), o.Token, info.FullMethod); err != nil {
			s.authFailed(ss.Context(), info.FullMethod)
			return err
		}
		if err := lim.acquire(info.FullMethod); err != nil {
			return err
		}
		defer lim.release(info.FullMethod)
		id := newRequestID()
		ss.SetHeader(metadata.Pairs("x-request-id", id))
		t0 := time.Now()
		err := h(srv, idStream{ss, context.WithValue(ss.Context(), requestIDKey{}, id)})
		s.observe(info.FullMethod, id, t0, err)
		return err
	}
	// Clients ping a connection with calls open (teacherdial's keepalive)
	// to find a daemon that hangs; the policy lets them.
	kep := grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: teacherdial.MinPingInterval, PermitWithoutStream: true})
	opts := append([]grpc.ServerOption{grpc.MaxRecvMsgSize(o.MaxRecvBytes), grpc.ChainUnaryInterceptor(unary), grpc.ChainStreamInterceptor(streamI), kep}, o.Extra...)
	gs := grpc.NewServer(opts...)
	pb.RegisterTeacherServer(gs, s)
	healthpb.RegisterHealthServer(gs, s.health)
	reflection.Register(gs)
	s.health.SetServingStatus("", healthpb.HealthCheckResponse_NOT_SERVING)
	s.health.SetServingStatus(pb.Teacher_ServiceDesc.ServiceName, healthpb.HealthCheckResponse_NOT_SERVING)
	return gs, s
}

// SetCore makes the server serve c and reports SERVING.
func (s *Server) SetCore(c *Core) {
	if err := c.met.reg.Register(s.authFailures); err != nil {
		s.log.Warn("auth failure counter not registered", zap.Error(err))
	}
	s.core.Store(c)
	s.health.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
	s.health.SetServingStatus(pb.Teacher_ServiceDesc.ServiceName, healthpb.HealthCheckResponse_SERVING)
}

// Draining reports NOT_SERVING so load balancers stop sending work.
func (s *Server) Draining() {
	s.health.Shutdown()
	s.drainOnce.Do(func() { close(s.draining) })
}
