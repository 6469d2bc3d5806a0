import type { ChannelCredentials } from "@grpc/grpc-js";

/** Tollgate's answer (or the unreachable policy's). */
export interface Decision {
  allowed: boolean;
  /** Tokens (or slots) left in the tightest bucket. */
  remaining: number;
  /** That bucket's capacity. */
  limit: number;
  /** Seconds to wait before the same request would be allowed. */
  retryAfter: number;
  /** Seconds until the bucket is full again. */
  resetAfter: number;
  /** The rule that decided. */
  rule: string;
  /** Header fields to send (RateLimit, RateLimit-Policy, Retry-After ...). */
  headers: Record<string, string>;
  /** A shadow rule would have refused it. */
  shadow: boolean;
  /** Tollgate's store was down and the rule's policy answered. */
  degraded: "failed_open" | "failed_closed" | "local" | null;
  /** Tollgate itself was unreachable; the client's policy answered. */
  unreachable: boolean;
}

export interface BatchDecision {
  allowed: boolean;
  items: Decision[];
  retryAfter: number;
  unreachable: boolean;
}

export interface Item {
  key: string;
  cost?: number;
  tenant?: string;
  resource?: string;
}

export interface Asking {
  cost?: number;
  tenant?: string;
  resource?: string;
}

export interface Reservation {
  decision: Decision;
  /** The reservation token ("" when none was recorded). */
  token: string;
  estimate: number;
  /** What to settle at; unset: the estimate, or 0 when the work throws. */
  used?: number;
}

export interface Slot {
  decision: Decision;
  /** The lease token ("" when none is held). */
  lease: string;
  inFlight: number;
  limit: number;
}

export type Policy = "open" | "closed";

export interface Options {
  tenant?: string;
  /** Milliseconds per call (default 250). */
  timeout?: number;
  /** What to answer when Tollgate cannot be reached (default "open"). */
  onUnreachable?: Policy;
  credentials?: ChannelCredentials;
}

export class Tollgate {
  constructor(target?: string, options?: Options);
  readonly tenant: string;
  readonly timeout: number;
  readonly onUnreachable: Policy;
  close(): void;
  shouldAllow(key: string, options?: Asking & { dryRun?: boolean }): Promise<Decision>;
  batch(items: Item[]): Promise<BatchDecision>;
  /** Waits each refusal's retryAfter (plus up to `jitter` of it), for at most `maxWait` ms. */
  waitAllowed(key: string, options?: Asking & { maxWait?: number; jitter?: number }): Promise<Decision>;
  settle(token: string, actual: number): Promise<void>;
  /** Reserves, runs `work`, settles in a finally. Throws RateLimited when refused. */
  reserve<T>(key: string, estimate: number, work: (r: Reservation) => Promise<T> | T): Promise<T>;
  reserve<T>(
    key: string,
    estimate: number,
    options: { tenant?: string; resource?: string; ttl?: number },
    work: (r: Reservation) => Promise<T> | T,
  ): Promise<T>;
  /** Holds a concurrency slot while `work` runs. Throws RateLimited when full. */
  slot<T>(key: string, work: (s: Slot) => Promise<T> | T): Promise<T>;
  slot<T>(
    key: string,
    options: { tenant?: string; resource?: string; ttl?: number; cost?: number },
    work: (s: Slot) => Promise<T> | T,
  ): Promise<T>;
}

export class RateLimited extends Error {
  readonly decision: Decision;
}

export class TollgateError extends Error {
  /** The gRPC status code. */
  readonly code: number;
  /** Its name: INVALID_ARGUMENT, FAILED_PRECONDITION ... */
  readonly codeName: string;
  /** What to fix. */
  readonly details: string;
}

export interface MiddlewareOptions<R> {
  /** The caller's key (default: the x-api-key header, else the client address). */
  key?: (req: R) => string | null | undefined;
  cost?: number | ((req: R) => number);
  tenant?: string | ((req: R) => string);
  resource?: string | ((req: R) => string);
}

/** Express middleware: 429 with Tollgate's headers when refused. */
export function expressMiddleware(
  client: Tollgate,
  options?: MiddlewareOptions<any>,
): (req: any, res: any, next: (err?: unknown) => void) => void;

/** A Fastify onRequest hook doing the same. */
export function fastifyHook(client: Tollgate, options?: MiddlewareOptions<any>): (request: any, reply: any) => Promise<unknown>;
